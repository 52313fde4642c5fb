"""`python -m lit_growattn fit|validate|test …` (LightningCLI), `python -m lit_growattn convert …` and
`python -m lit_growattn export --ckpt CKPT --out DIR` (a Hugging Face model folder, `lit_growattn.commands.export`).

An error is reported as the project's own message in a few lines, not as jsonargparse's and Lightning's
wrappers around it; `LIT_GROWATTN_DEBUG=1` shows the full traceback instead.
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

DEBUG_ENV = "LIT_GROWATTN_DEBUG"


def causes(error: BaseException) -> list[BaseException]:
    """The chain of `raise … from`, outermost first."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    return chain


def raised_by_project(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__) if error.__traceback__ else []
    return bool(frames) and os.path.dirname(__file__) in frames[-1].filename


def first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")


def shown(error: BaseException) -> BaseException:
    """What the report says of `error`: where torch refused to load a file with weights_only=True (e.g. a model
    folder's pytorch_model.bin, loaded by transformers), the project's refusal instead of torch's message, which
    advises loading the file with weights_only=False, for a file that may run code."""
    from lit_growattn.training.checkpoint import refusal, unsafe_load_refused

    return refusal("a file being loaded", error) if unsafe_load_refused(error) else error


def short_report(error: BaseException) -> str:
    """The project's own message (the outermost one it raised: jsonargparse wraps a failing __init__ in "Does
    not validate against any of the Union subtypes"), and the first line of the root cause under it, if any."""
    chain = causes(error)
    own = next((e for e in chain if raised_by_project(e)), chain[-1])
    where = traceback.extract_tb(own.__traceback__)[-1] if own.__traceback__ else None
    lines = [f"error: {type(shown(own)).__name__}: {shown(own)}"]
    if chain[-1] is not own:
        lines.append(f"  (caused by {first_line(shown(chain[-1]))})")
    if where is not None:
        lines.append(f"  (raised at {where.filename}:{where.lineno})")
    lines.append(f"  (full traceback: run again with {DEBUG_ENV}=1)")
    return "\n".join(lines)


# Lightning's WeightAveraging warns that it does not shard its copy whenever the module overrides configure_model, as
# GrowableLM does for ModelParallelStrategy (FSDP2). Under the strategies a weight-averaging callback may be combined
# with growth (one device, DDP) configure_model does nothing and the copy was never to be sharded; under
# ModelParallelStrategy configure_model refuses weight averaging before that copy is made.
WEIGHT_AVERAGING_SHARDING = r"You're using the WeightAveraging callback with a model that overrides the configure_model"


def hide_library_noise() -> None:
    """Messages Lightning prints on fits that a user of this command can do nothing about; after
    Lightning is imported (the tips' logger is the one Lightning installs then)."""
    from lightning_utilities.core import rank_zero

    # Lightning's own pytree helper calls `isinstance(treespec, LeafSpec)`, which torch 2.13 deprecates: the
    # FutureWarning names no code of the user's or ours, and the fix is Lightning's.
    leaf_spec = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
    warnings.filterwarnings("ignore", message=leaf_spec, category=FutureWarning)
    warnings.filterwarnings("ignore", message=WEIGHT_AVERAGING_SHARDING, category=UserWarning)
    # Under ModelParallelStrategy `last.ckpt` is a distributed checkpoint folder that ModelCheckpoint rewrites at every
    # save, as it rewrites the file under other strategies; torch's writer notes each time that it overwrites one and
    # that its default may change. Lightning chooses the writer, not the user.
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*, overwriting since "
                            r"self.overwrite=True", category=UserWarning)
    # A resumed run logs to a new version_N (docs/checkpoints.md), so ModelCheckpoint always finds another folder
    # than the checkpoint's and notes, on every rank, that the old folder's top-k bookkeeping is not carried over:
    # the intent, and no setting of the user's changes it.
    warnings.filterwarnings("ignore", message=r"The dirpath has changed from ", category=UserWarning)
    # Advertising for Lightning's cloud services ("💡 Tip: … install litlogger / litmodels") at INFO level;
    # Lightning has no switch for it, and raising the logger's level would hide its useful lines (devices, limits).
    rank_zero.log.addFilter(lambda record: not record.getMessage().startswith("💡 Tip:"))


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if args[:1] == ["convert"]:
            from lit_growattn.commands.convert import main as convert

            convert(args[1:])
        elif args[:1] == ["export"]:
            from lit_growattn.commands.export import main as export

            export(args[1:])
        else:
            from lit_growattn.commands.cli import main as cli

            hide_library_noise()
            cli(argv)  # None: LightningCLI reads sys.argv itself (and does not warn about it)
    except Exception as error:  # noqa: BLE001 - the command line's last resort; SystemExit passes through
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        print(short_report(error), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
