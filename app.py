"""SpecUI entry point: flags -> load the model pair -> headless CLI or the web app."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from specui.cli import build_parser, run_cli
    from specui.engine.host_cpus import threads_for_quota
    from specui.errors import SpecUIError

    args = build_parser().parse_args(argv)
    if note := threads_for_quota():  # before torch is imported, here or in the engine's process
        print(note, file=sys.stderr)
    try:
        if args.cli or args.doctor or args.profile or args.quantization_options:
            return run_cli(args)
        from specui.webapp import launch

        return launch(args)
    except SpecUIError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl+C before the app was up (a load takes a while): no traceback
        print("\nstopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
