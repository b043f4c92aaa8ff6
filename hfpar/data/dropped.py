"""No silent data loss: what tokenization left out or cut, said in one line per split before training.

    lines = data_loss_lines(info, args)      # info: build_data's {"train_data": stats, "eval_data": stats}
    announce_data_loss(info, args, print)    # prints them; raises DataError when almost nothing is left

Left out: an SFT example whose every target token lies past --max_seq_length (a long prompt: the assistant reply
is cut away entirely, nothing to learn from it), or any example longer than it under --truncation drop; empty
texts (clm). Cut: examples truncated to --max_seq_length that kept some targets. A split that loses more than
MAX_LOST_FRACTION of its examples is refused (as the dpo recipe refuses a pair its limits empty): the options
would silently train on a small, length-biased remainder. Raise --max_seq_length, or shorten the prompts.
"""

from __future__ import annotations

from .errors import DataError

MAX_LOST_FRACTION = 0.9  # more than 90% of a split's examples left out (almost none remain): refused


def _split_line(split: str, stats: dict, args) -> tuple[str | None, bool]:
    """(one line or None, refuse) for one split's tokenization stats."""
    total = stats.get("examples", stats.get("pairs"))
    if not total:
        return None, False
    no_targets, dropped = stats.get("no_targets", 0), stats.get("dropped", 0)
    cut_away = stats.get("cut_away", 0)
    lost, cut = no_targets + dropped, stats.get("truncated", 0) - cut_away
    if not lost and not cut:
        return None, False
    limit = f"--max_seq_length {args.max_seq_length}"
    why = []
    if cut_away:
        why.append(f"{cut_away} with every target token past {limit}")
    if no_targets - cut_away:
        why.append(f"{no_targets - cut_away} with no target token at all")
    if dropped:
        why.append(
            f"{dropped} longer than {limit} under --truncation drop"
            if getattr(args, "truncation", "") == "drop"
            else f"{dropped} empty"
        )
    parts = []
    if lost:
        parts.append(f"{lost} of {total} examples left out ({'; '.join(why)})")
    if cut:
        parts.append(
            f"{cut} of {total} cut to {limit}"
            if "pairs" not in stats
            else f"{cut} of {total} pairs cut to --max_length"
        )
    refuse = lost / total > MAX_LOST_FRACTION
    fix = "raise --max_seq_length or shorten the prompts"
    if refuse:
        return (
            f"{split} data: {', '.join(parts)}: more than {MAX_LOST_FRACTION:.0%} of the examples would be left "
            f"out; {fix}"
        ), True
    return f"{split} data: {', '.join(parts)}" + (f" ({fix} to keep them)" if lost else ""), False


def data_loss_lines(info: dict, args) -> tuple[list[str], list[str]]:
    """(notes, problems) for the splits of build_data's info."""
    notes, problems = [], []
    for split in ("train", "eval"):
        stats = info.get(f"{split}_data")
        if not isinstance(stats, dict):
            continue
        line, refuse = _split_line(split, stats, args)
        if line:
            (problems if refuse else notes).append(line)
    return notes, problems


def announce_data_loss(info: dict, args, say=print, train_rows: int | None = None, dp: int = 1) -> None:
    """Every note said with `say` (the main process's print); a split that lost most of its examples, or a train
    split of fewer rows than one global batch (the sampler's limit, found before the model loads): DataError."""
    notes, problems = data_loss_lines(info, args)
    global_batch = args.per_device_train_batch_size * dp * args.gradient_accumulation_steps
    if train_rows is not None and train_rows < global_batch:
        problems.append(
            f"the training set has {train_rows} rows, fewer than one global batch of {global_batch} "
            f"(--per_device_train_batch_size {args.per_device_train_batch_size} x dp {dp} x "
            f"--gradient_accumulation_steps {args.gradient_accumulation_steps}): lower them or add data"
        )
    if problems:
        raise DataError("\n".join(problems))
    for line in notes:
        say(f"[hfpar] {line}")
