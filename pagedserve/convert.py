"""`pagedserve convert`: a GGUF model made into a checkpoint ahead of time, and ``up``'s use of it.

Every process converts a GGUF ``--model`` it is given on first use (``contracts.checkpoints``,
under a file lock), so this is never required; ``up`` runs it as a child process before it
starts the stack, so that the kvstore, the workers and the gateway start with the checkpoint
there (and ``up`` itself never imports torch).
"""

from __future__ import annotations

import logging
import signal
import sys
from dataclasses import dataclass

from contracts import options
from contracts.checkpoints import SMOLLM2, converted_dir, gguf_source, resolve_model
from pagedserve.procs import spawn_process

log = logging.getLogger("pagedserve")


@dataclass(frozen=True)
class ConvertConfig:
    model: str = options.model("", SMOLLM2)


def run_convert(config: ConvertConfig) -> None:
    """Converts ``config.model`` if it is a GGUF model not converted yet; prints the checkpoint
    directory (or ``tiny``). A model that cannot be found or read: one line, exit status 1."""
    options.configure_logging("INFO")
    try:
        print(resolve_model(config.model), flush=True)
    except FileNotFoundError as err:
        raise SystemExit(f"pagedserve convert: {err}") from None
    except KeyboardInterrupt:
        raise SystemExit("pagedserve convert: interrupted; nothing was kept") from None
    except Exception as err:  # a file transformers cannot read: one line, the rest at DEBUG
        log.debug("conversion failed", exc_info=True)
        message = f"{type(err).__name__}: {err}"
        raise SystemExit(f"pagedserve convert: cannot convert {config.model}: {message}") from None


def convert_before_start(model: str) -> None:
    """For ``up``: exits with one line if ``model`` cannot be found; converts a GGUF model not
    converted yet in a ``pagedserve convert`` child (its progress on this terminal). Ctrl-C
    stops it (it removes what it wrote) and exits."""
    try:
        source = gguf_source(model)
        if source is None or converted_dir(source).is_dir():
            return
    except OSError as err:
        raise SystemExit(f"pagedserve up: {err}") from None
    log.info("model %s: converting %s into a checkpoint first (once)", model, source)
    child = spawn_process("convert", ["--model", model], stdout=sys.stderr)
    try:
        status = child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)  # a terminal's Ctrl-C reached it too, `kill -INT` not
        child.wait()
        raise SystemExit("pagedserve up: interrupted while converting the model") from None
    if status != 0:
        raise SystemExit(f"pagedserve up: converting {model} failed (exit status {status})")
