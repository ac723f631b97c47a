"""Rank 0's token ids cross to the host in two ops (I11): `enqueue_sample` behind the forward,
`read_tokens` after the step's synchronize. The executor refuses a read of a step it did not
sample, and a second read of one it did."""

from __future__ import annotations

import pytest
import torch

from engine.engine_config import EngineConfig
from engine.executor import RankExecutor
from engine.parallel import SINGLE
from protocol.commands import DecodeRow, Step


def _executor(tiny_dir, max_batch: int) -> RankExecutor:
    """A CPU executor of the tiny model, eager, each slot on pages of its own."""
    settings = EngineConfig.create(tiny_dir, max_batch=max_batch, max_model_len=32,
                                   page_size=16, cuda_graph=False)
    ex = RankExecutor(settings, SINGLE)
    ex.load_model()
    ex.allocate_kv(ex.pages_needed())
    ex.assign_pages_per_slot()
    return ex


@pytest.mark.timeout(120)
def test_read_tokens_returns_the_enqueued_steps_ids_once(tiny_dir):
    ex = _executor(tiny_dir, max_batch=4)
    step = Step(seq=3, rows=tuple(DecodeRow(slot=s, request_id=s, token=10 + s, position=5)
                                  for s in range(2)), bucket=2)
    ex.slots.f[0, :2] = 1.0  # inverse temperature 1, no noise: greedy rows
    ex.run_eager(step)
    want = ex._decode_logits[:2].argmax(dim=-1).tolist()
    ex.enqueue_sample(step)
    with pytest.raises(RuntimeError, match="step 4: no sampled tokens to read; enqueue_sample "
                                           "must run for this step first"):
        ex.read_tokens(Step(seq=4, rows=step.rows, bucket=2))
    ex.synchronize()
    assert ex.read_tokens(step) == tuple(want)
    with pytest.raises(RuntimeError, match="step 3: no sampled tokens to read"):
        ex.read_tokens(step)


def test_a_batch_with_a_host_top_k_bound_samples_the_same_tokens():
    """`BatchParams.max_top_k` (the live top-k values' maximum, kept on the host so the top-k
    cut needs no device-to-host sync) gives the tokens the bound read from the tensor gives."""
    from engine.sampling import BatchParams, SamplingParams, sample_batch

    params = [SamplingParams(temperature=0.7, top_k=k, seed=i) for i, k in enumerate((3, 50, 0))]
    bp = BatchParams.from_params(params, [1, 2, 3], [0, 4, 9])
    logits = torch.randn(3, 400, generator=torch.Generator().manual_seed(0))
    read, _ = sample_batch(logits, bp)
    bound = BatchParams(**{**bp.__dict__, "max_top_k": 50})
    assert torch.equal(sample_batch(logits, bound)[0], read)
    wider = BatchParams(**{**bp.__dict__, "max_top_k": 399})  # any bound >= every top_k
    assert torch.equal(sample_batch(logits, wider)[0], read)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fed", [False, True])
def test_a_long_bucket_sends_its_rows_longest_first_with_the_steps_rows(tiny_dir, fed):
    """From ORDER_MIN_ROWS rows on, `prepare_replay` packs the row order (longest first,
    padding rows last) into the step's one copy; the tokens, positions and slots stay where
    the forward reads them."""
    from engine.kernels.decode_attention import ORDER_MIN_ROWS, longest_first

    ex = _executor(tiny_dir, max_batch=80)
    settings = ex.settings
    n = ORDER_MIN_ROWS + 3
    bucket = min(b for b in settings.buckets if b >= n)
    assert bucket > n  # padding rows too
    positions = [1 + (7 * s) % 30 for s in range(n)]  # ties among them
    rows = tuple(DecodeRow(slot=s, request_id=s, token=10 + s, position=positions[s])
                 for s in range(n))
    feed = tuple(reversed(range(n))) if fed else None
    ex._sampled_dev[:n] = torch.arange(100, 100 + n)
    ex.prepare_replay(Step(seq=1, rows=rows, bucket=bucket, feed=feed))
    order = ex._replay_in[4, :bucket].tolist()
    assert order == longest_first(torch.tensor(positions + [0] * (bucket - n))).tolist()
    assert sorted(order) == list(range(bucket)) and set(order[n:]) == set(range(n, bucket))
    assert ex.positions[:bucket].tolist() == positions + [0] * (bucket - n)
    assert ex.slot_ids[:n].tolist() == list(range(n))
    want = [100 + f for f in feed] if fed else [10 + s for s in range(n)]
    assert ex.input_ids[:n].tolist() == want
    # the forward hands that row to decode attention (the CPU's torch path ignores it)
    seen = []
    attention = ex.decode_attention

    def spy(*args):
        seen.append(args[-1])  # row_order, the last positional argument
        return attention(*args)

    ex.decode_attention = spy
    ex.decode_forward(bucket)
    assert seen and all(o is not None and o.data_ptr() == ex._replay_in[4].data_ptr()
                        and o.tolist() == order for o in seen)
    # padding launches after the long step: an ordered bucket below it reads the identity
    # (not the long step's order, whose indices run past it), a short one no order at all
    assert ORDER_MIN_ROWS in settings.buckets and ORDER_MIN_ROWS < bucket
    for rows, want_order in ((ORDER_MIN_ROWS, list(range(ORDER_MIN_ROWS))),
                             (min(settings.buckets), None)):
        seen.clear()
        ex._pad_rows(rows)
        ex.decode_forward(rows)
        assert seen and all((o.tolist() if o is not None else None) == want_order for o in seen)
