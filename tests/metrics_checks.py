"""What the tests of the figures' way into loggers share: TensorBoard's own reader, and the bytes
a one-bucket top-k hook moves per step, worked out from the bucket's size and k."""
import math


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``log_dir`` (not its subdirectories), read by
    TensorBoard's EventAccumulator: tag -> [(step, value), ...] in the order written."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def bytes_sent_per_step(numel: int, density: float, first: int, last: int, warmup_steps: int = 2) -> float:
    """Mean bytes a rank sends per step over steps ``first..last`` (1-based) of a one-bucket
    float32 job with budget="bucket": the whole bucket in warm-up (a ring allreduce's buffer),
    then ``k`` int32 indices and ``k`` float32 values plus the 8-byte seal of the all-gather."""
    k = math.ceil(density * numel)
    sent = [4 * numel if step <= warmup_steps else 8 * k + 8 for step in range(first, last + 1)]
    return sum(sent) / len(sent)
