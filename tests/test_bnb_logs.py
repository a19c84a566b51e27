"""bitsandbytes' per-forward cast notice (8bit) is dropped once a model loads on it; other
warnings of the same logger still show."""

import logging
import warnings

from specui.weights.bnb_logs import CAST_NOTICE, LOGGER, quiet_int8_cast


def test_the_cast_notice_is_dropped_and_nothing_else(caplog):
    log = logging.getLogger(LOGGER)
    before = list(log.filters)
    log.filters[:] = [f for f in before if type(f).__name__ != "_DropCastNotice"]  # as before any 8bit load
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            log.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.float32")
            assert len(caplog.records) == 1  # shown before
            quiet_int8_cast()
            quiet_int8_cast()  # idempotent: one filter
            assert sum(type(f).__name__ == "_DropCastNotice" for f in log.filters) == 1
            log.warning("MatMul8bitLt: inputs will be cast from %s to float16 during quantization", "torch.float32")
            log.warning("something else")
            assert [r.getMessage() for r in caplog.records][1:] == ["something else"]
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            quiet_int8_cast()  # (inside catch_warnings: its filter goes when the block ends)
            warnings.warn(f"{CAST_NOTICE} from torch.float32 to float16 during quantization", UserWarning, stacklevel=2)
            warnings.warn("another", UserWarning, stacklevel=2)
            assert [str(w.message) for w in seen] == ["another"]
    finally:
        log.filters[:] = before
