"""bitsandbytes' 8-bit product (LLM.int8()) says on every forward that it casts its inputs to
float16 (`MatMul8bitLt: inputs will be cast ...`): a line a layer a token, hundreds a reply on
stderr, as a logging warning in recent versions and a Python warning in older ones. A model
loaded on `--quantization 8bit` says it once in its load note instead."""

from __future__ import annotations

import logging
import warnings

CAST_NOTICE = "MatMul8bitLt: inputs will be cast"
LOGGER = "bitsandbytes.autograd._functions"
NOTE = "bitsandbytes 8bit: its products cast each layer's inputs to float16"


class _DropCastNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(CAST_NOTICE)


def quiet_int8_cast() -> None:
    """Drop the per-forward cast notice (both kinds); idempotent."""
    warnings.filterwarnings("ignore", message=f".*{CAST_NOTICE}.*")
    log = logging.getLogger(LOGGER)
    if not any(isinstance(f, _DropCastNotice) for f in log.filters):
        log.addFilter(_DropCastNotice())
