"""Integer-like token ids are accepted and other types are rejected by type, with one line naming
the value; the Python API never lets a raw TypeError through (issue 13, item 6)."""

from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from engine.errors import ModelDirError, ParallelConfigError, RequestError
from engine.llm import LLM
from engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_dir):
    with LLM(tiny_dir, max_batch=4, max_model_len=64) as engine:
        yield engine


def test_numpy_and_torch_integer_ids_are_token_ids(llm):
    want = llm.generate([1, 2, 3], GREEDY)[0].token_ids
    for prompt in ([np.int64(1), np.int32(2), 3], np.array([1, 2, 3]), torch.tensor([1, 2, 3]),
                   [torch.tensor(1), 2, np.int16(3)]):
        out, = llm.generate(prompt, GREEDY)
        assert out.error is None and out.prompt_token_ids == [1, 2, 3]
        assert out.token_ids == want
    outs = llm.generate(np.array([[1, 2, 3], [1, 2, 3]]), GREEDY)
    assert [o.token_ids for o in outs] == [want, want]
    out, = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0,
                                                  stop_token_ids=(np.int64(want[0]),)))
    assert out.token_ids == want[:1] and out.finish_reason == "stop"


def test_plain_int_prompts_are_copied_as_they_are(llm):
    prompt = (1, 2, 3)
    out, = llm.generate([prompt], GREEDY)
    assert out.error is None and out.prompt_token_ids == [1, 2, 3]
    ids = [4, 5]
    assert llm._tokenize(ids) == ids and llm._tokenize(ids) is not ids  # a copy


@pytest.mark.parametrize("prompt, fragment", [
    ([1.0, 2], "prompt token id 1.0 is a float"),
    ([np.float32(1)], "is a float32"),
    ([torch.tensor(1.0)], "is a Tensor"),
    ([True, 2], "prompt token id True is a bool"),
    ([1, "2"], "prompt token id '2' is a str"),
    ([1, None], "prompt token id None is a NoneType"),
    ([np.int64(10**6)], "outside the vocabulary"),
    # plain ints take the C-level path; out of range they still get the per-token message
    ([1, 2, -1], "prompt token id -1 outside the vocabulary"),
    ((3, 10**6, 2), "prompt token id 1000000 outside the vocabulary"),
    ([5, True], "prompt token id True is a bool"),
])
def test_non_integer_ids_are_rejected_by_type(llm, prompt, fragment):
    out, = llm.generate([prompt], GREEDY)
    assert isinstance(out.error, RequestError) and fragment in str(out.error)


def test_bad_prompts_and_params_are_request_errors(llm):
    out, = llm.generate([None], GREEDY)
    assert "prompt None is neither a text nor a list of token ids" in str(out.error)
    with pytest.raises(RequestError, match="prompts = None"):
        llm.generate(None, GREEDY)
    with pytest.raises(RequestError, match="prompts = 5"):
        llm.generate(5, GREEDY)
    with pytest.raises(RequestError, match="params is a dict, expected a SamplingParams"):
        llm.generate([[1, 2, 3]], {"max_tokens": 2})  # a dict, not a SamplingParams
    for params, fragment in ((SamplingParams(stop_token_ids=5), "stop_token_ids = 5"),
                             (SamplingParams(stop_token_ids=[1.5]), "stop token id 1.5 is a float"),
                             (SamplingParams(max_tokens="3"), "max_tokens = '3'"),
                             (SamplingParams(top_k=2.0), "top_k = 2.0"),
                             (SamplingParams(temperature="hot"), "temperature = 'hot'"),
                             (SamplingParams(seed=1.5), "seed = 1.5"),
                             (SamplingParams(top_k=10**30), "top_k = 10000000000"),
                             (SamplingParams(temperature=1e-320), "temperature = 1e-320"),
                             (SamplingParams(temperature=True), "temperature = True"),
                             (SamplingParams(logprobs=5), "logprobs = 5, expected True or False"),
                             (SamplingParams(ignore_eos="yes"), "ignore_eos = 'yes'"),
                             (SamplingParams(return_logits=3), "return_logits = 3")):
        out, = llm.generate([[1, 2]], params)
        assert isinstance(out.error, RequestError) and fragment in str(out.error), out.error


@pytest.mark.parametrize("kwargs, error, fragment", [
    (dict(step_timeout_s=0), ParallelConfigError, "step_timeout_s = 0"),
    (dict(step_timeout_s=-1, startup_timeout_s=10), ParallelConfigError, "step_timeout_s = -1"),
    (dict(step_timeout_s=float("nan"), startup_timeout_s=10), ParallelConfigError,
     "step_timeout_s = nan"),
    (dict(step_timeout_s=0, startup_timeout_s=10), ParallelConfigError, "step_timeout_s = 0"),
    (dict(startup_timeout_s=0), ParallelConfigError, "startup_timeout_s = 0"),
])
def test_timeouts_are_checked_each_under_its_own_name(tiny_dir, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        LLM(tiny_dir, **kwargs)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("model_dir", [None, 5, ["dir"]])
def test_model_dir_of_the_wrong_type(model_dir):
    with pytest.raises(ModelDirError, match="model_dir = "):
        LLM(model_dir)


@pytest.mark.parametrize("model_dir", ["", "  "])
def test_an_empty_model_dir_is_named_empty_not_read_as_the_current_directory(model_dir):
    """Old behaviour: `LLM("")` said "config.json: missing (is '.' a Hugging Face model
    dir?)", as `lockstep generate --model ''` did before its own check."""
    with pytest.raises(ModelDirError) as info:
        LLM(model_dir)
    assert str(info.value) == f"model_dir = {model_dir!r} is empty; name the model directory"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(progress="true"), "progress = 'true'"),
    (dict(record_trace=0), "record_trace = 0"),
    (dict(_graph_standin=1), "graph_standin = 1"),
    (dict(_fault=(3, 6, "kill"), tensor_parallel_size=2), r"fault = \(3, 6, 'kill'\): rank 3"),
    (dict(_fault=(1, 6, "boom"), tensor_parallel_size=2), "kind 'boom'"),
])
def test_test_hooks_are_checked_before_any_rank_starts(tiny_dir, kwargs, fragment):
    with pytest.raises(ParallelConfigError, match=fragment):
        LLM(tiny_dir, **kwargs)
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("params, words", [
    (SamplingParams(max_tokens=np.int64(3)), "max_tokens = np.int64(3) is a int64, expected a "
                                             "Python int: pass int(...)"),
    (SamplingParams(top_k=torch.tensor(3)), "top_k = tensor(3) is a Tensor, expected a Python "
                                            "int"),
    (SamplingParams(seed=np.uint64(5)), "seed = np.uint64(5) is a uint64, expected a Python int"),
    (SamplingParams(temperature=np.float32(0.5)), "temperature = np.float32(0.5) is a float32, "
                                                  "expected a Python float: pass float(...)"),
    (SamplingParams(top_p=torch.tensor(0.5)), "top_p = tensor(0.5000) is a Tensor, expected a "
                                              "Python float"),
])
def test_numpy_and_torch_scalars_in_sampling_params_are_named_by_type(params, words):
    """Old behaviour: `max_tokens=np.int64(3)` was refused as "expected an integer >= 1" and
    `temperature=np.float32(0.5)` as "expected a finite number >= 0", though each is one."""
    with pytest.raises(RequestError) as info:
        params.validate(vocab_size=512)
    assert str(info.value).startswith(words), info.value


def test_a_numpy_float64_is_a_python_float_and_is_taken():
    params = SamplingParams(temperature=np.float64(0.5), top_p=np.float64(0.9))
    assert params.validate(vocab_size=512) is None  # raises RequestError if refused


def test_an_error_no_check_foresaw_leaves_no_accepted_request_behind(llm, monkeypatch):
    """Found by a fresh user: a 0-d array as a stop id passed the checks, then `set()` raised
    a raw TypeError after the first request of the call had been submitted; that request ran
    in the next call, unreturned, and its tokens stayed in the controller. Every request is
    now checked before any is submitted, so an unforeseen error leaves nothing behind."""
    import engine.llm as llm_mod

    def broken(self, prompt, p):
        if p.max_tokens == 2:
            raise TypeError("a check that raises what no check foresaw")
        return original(self, prompt, p)

    original = llm_mod.LLM._check_request
    monkeypatch.setattr(llm_mod.LLM, "_check_request", broken)
    with pytest.raises(TypeError):
        llm.generate([[1, 2, 3], [4]], [GREEDY, SamplingParams(max_tokens=2)])
    monkeypatch.undo()
    assert llm._extras == {} and not llm.controller.outputs
    assert not llm.controller.requests
    out, = llm.generate([[5, 6]], GREEDY)
    assert out.error is None and len(out.token_ids) == 3
    assert llm._extras == {} and not llm.controller.outputs


@pytest.mark.parametrize("spell", [
    lambda t: [np.array(t)], lambda t: [torch.tensor(t)], lambda t: torch.tensor([t]),
    lambda t: np.array([t]), lambda t: [np.int64(t)], lambda t: {t},
], ids=["0-d array", "0-d tensor", "tensor", "array", "int64", "set"])
def test_stop_ids_of_numpy_and_torch_types_stop_the_request(llm, spell):
    """A 0-d array as a stop id was unhashable (a raw TypeError) and a torch scalar hashed by
    identity, so it never matched the sampled id: the request ran to max_tokens."""
    want = llm.generate([1, 2, 3], GREEDY)[0].token_ids
    out, = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, temperature=0,
                                                  stop_token_ids=spell(want[1])))
    assert out.error is None and out.token_ids == want[:2] and out.finish_reason == "stop"


@pytest.mark.parametrize("stop, shown", [
    ((t for t in [5]), "stop_token_ids = <generator object"),
    (iter([5]), "stop_token_ids = <list_iterator object"),
    ({5: 1}, "stop_token_ids = {5: 1}"),
    (torch.tensor([[1, 2], [3, 4]]), "stop_token_ids = tensor([[1, 2], [3, 4]])"),
    (np.array(5), "stop_token_ids = array(5), expected a list"),
    (torch.tensor(5), "stop_token_ids = tensor(5), expected a list"),
])
def test_stop_ids_read_once_or_of_no_order_are_refused(llm, stop, shown):
    """A generator of stop ids was used up by the check and left none: the request ran to
    max_tokens with no word. A matrix's repr is on several lines; the error is one. A 0-d
    array was a raw "iteration over a 0-d array" for the whole call (a reviewer's finding)."""
    out, = llm.generate([1, 2, 3], SamplingParams(max_tokens=3, stop_token_ids=stop))
    assert isinstance(out.error, RequestError), out.error
    assert str(out.error).startswith(shown) and "\n" not in str(out.error), out.error


@pytest.mark.parametrize("prompts", [np.array(5), torch.tensor(5), {0: 5}, {"a": [1, 2]}])
def test_a_scalar_array_or_a_dict_as_prompts_is_named(llm, prompts):
    """`generate(np.array(5))` was a raw "iteration over a 0-d array"; `generate({0: 5})` was
    served as the prompt [0], the dict's keys."""
    with pytest.raises(RequestError, match=r"^prompts = .*, expected a text, a list of token "):
        llm.generate(prompts, GREEDY)
    out, = llm.generate([[1, 2, 3]], GREEDY)
    assert out.error is None


def test_a_meta_tensor_token_id_is_named_as_a_tensor(llm):
    """torch's "Tensor.item() cannot be called on meta tensors" came through raw."""
    good, bad = llm.generate([[1, 2, 3], [torch.tensor(3, device="meta")]], [GREEDY, GREEDY])
    assert good.error is None and len(good.token_ids) == 3
    assert str(bad.error).startswith("prompt token id tensor(..., device='meta'")


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(dtype=""), "dtype = '', expected one of"),
    (dict(dtype=0), "dtype = 0, expected one of"),
    (dict(page_size=2**28), "page_size = 268435456, expected at most 64: one page holds a "
                            "whole sequence of max_model_len 64 tokens"),
    (dict(page_size=128), "page_size = 128, expected at most 64"),
])
def test_a_falsy_dtype_or_a_page_past_the_longest_sequence_is_refused(tiny_dir, kwargs,
                                                                       fragment, nothing_loads):
    """dtype "" or 0 read as "the checkpoint's"; page_size 2**28 started the rank, whose KV
    allocation then failed with the CPU allocator's message."""
    with pytest.raises(ParallelConfigError, match=fragment):
        LLM(tiny_dir, max_model_len=64, **kwargs)
    assert multiprocessing.active_children() == []


def test_a_page_as_long_as_the_longest_sequence_is_taken(tiny_dir):
    with LLM(tiny_dir, max_model_len=48, page_size=64) as engine:
        out, = engine.generate([[1, 2, 3]], GREEDY)
    assert out.error is None and len(out.token_ids) == 3


def test_an_engine_config_built_directly_is_checked(tiny_dir):
    """`LLM(EngineConfig(..., dtype="float64"))` was a raw KeyError from the dtype's bytes."""
    from engine.engine_config import EngineConfig

    with pytest.raises(ParallelConfigError, match="dtype = 'float64', expected one of"):
        LLM(EngineConfig(model_dir=str(tiny_dir), dtype="float64"))
    assert multiprocessing.active_children() == []


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fields, error, words", [
    (dict(startup_timeout_s=float("nan")), ParallelConfigError, "startup_timeout_s = nan, "),
    (dict(startup_timeout_s=float("inf")), ParallelConfigError, "startup_timeout_s = inf, "),
    (dict(step_timeout_s=float("nan")), ParallelConfigError, "step_timeout_s = nan, "),
    (dict(step_timeout_s=0), ParallelConfigError, "step_timeout_s = 0, expected a positive"),
    (dict(world_size=0), ParallelConfigError, "world_size = 0, expected a positive integer"),
    (dict(world_size=3), ParallelConfigError, "is not divisible by tensor_parallel_size = 3"),
    (dict(model_dir=None), ModelDirError, "model_dir = None, expected a path"),
    (dict(max_model_len=4096), ParallelConfigError,
     "max_model_len = 4096 exceeds the model's max_position_embeddings 2048"),
])
def test_an_engine_config_built_directly_gets_the_checks_of_create(tiny_dir, fields, error,
                                                                   words):
    """A fresh user's `LLM(EngineConfig(...))`: a NaN startup timeout expired at once and
    aborted the Python process (SIGABRT), an infinite one crashed the watchdog's thread and
    served with no watchdog, world size 0 was a ZeroDivisionError, model_dir None a pathlib
    TypeError, and a max_model_len past the model's positions was served. `validate` now runs
    `create`'s checks: one line, no rank started."""
    from engine.engine_config import EngineConfig

    with pytest.raises(error) as info:
        LLM(EngineConfig(**{"model_dir": str(tiny_dir), "max_model_len": 64, **fields}))
    assert words in str(info.value) and "\n" not in str(info.value), info.value
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("digits", [400, 5000])
@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "top_k", "seed",
                                   "max_tokens"])
def test_an_integer_past_the_largest_float_is_one_clipped_line_and_the_batch_is_served(
        llm, field, digits):
    """A fresh user's temperature=10**400 raised OverflowError out of `generate` (from
    math.isfinite), and the good request beside it got no result; the other fields' errors
    printed all 401 digits."""
    good, bad = llm.generate([[1, 2, 3], [4, 5]],
                             [GREEDY, SamplingParams(**{"max_tokens": 3, field: 10**digits})])
    assert good.error is None and len(good.token_ids) == GREEDY.max_tokens
    # past 4,300 digits repr itself raises ValueError (a reviewer's finding), so the value is
    # described by its length
    shown = "1000" if digits == 400 else "<an integer of about 5001 digits>"
    assert f"{field} = {shown}" in str(bad.error) or f"{field} {shown}" in str(bad.error)
    assert len(str(bad.error)) < 200 and "\n" not in str(bad.error)


@pytest.mark.parametrize("prompt, words", [
    ([1.0, 2.0], "prompt token id 1.0 is a float"),
    (np.array([1.0, 2.0, 3.0]), "prompt token id"),
    (torch.tensor([1.0, 2.0]), "prompt token id"),
    (torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "prompt token id"),
    (np.array([True, False]), "prompt token id"),
    ([True, 1], "prompt token id True"),
    (np.array([], dtype=np.int64), "prompt is empty"),
    (torch.tensor([], dtype=torch.long), "prompt is empty"),
])
def test_one_prompt_of_non_integer_items_is_one_refused_output(llm, prompt, words):
    """A fresh user's `generate([1.0, 2.0])` (or a float array or tensor) came back as one
    refused output per item, each "prompt 1.0 is neither a text nor a list of token ids", and
    an empty int64 array as no output at all; `[5, 1.5]` already gave one. Whatever its items,
    a flat prompt is one request with one error."""
    out, = llm.generate(prompt, GREEDY)
    assert str(out.error).startswith(words), out.error
    assert llm.generate([], GREEDY) == []  # an empty list is still an empty batch


def test_arrays_of_text_stay_batches_of_texts(llm):
    """A reviewer's finding on the rule above: an empty array of str (an empty batch of texts)
    read as one empty prompt, and a 0-d str array first in a list made the list one prompt."""
    assert llm.generate(np.array([], dtype=str), GREEDY) == []
    outs = llm.generate([np.array("hello"), "world"], GREEDY)
    assert len(outs) == 2


def _held_generate(engine, prompts):
    """Start ``engine.generate(prompts, GREEDY)`` in a thread that waits inside the call, its
    requests submitted and no step run, until the returned event is set. Returns (thread,
    release event, list that gets the call's outputs) once that thread is inside."""
    import threading

    inside, release = threading.Event(), threading.Event()
    drive = engine._drive

    def slow_drive():
        inside.set()
        release.wait(30)
        drive()

    engine._drive = slow_drive
    results = []
    thread = threading.Thread(target=lambda: results.append(engine.generate(prompts, GREEDY)))
    thread.start()
    assert inside.wait(30)
    return thread, release, results


@pytest.mark.timeout(120)
def test_a_generate_call_while_another_thread_s_runs_is_refused_and_nothing_leaks(llm):
    """A fresh user's two threads calling `generate` on one LLM: one failed inside the
    controller ("controller waits for ranks (0,) after collect") and its 8 accepted requests
    were never returned, left in the controller's tables. The second call is now refused
    before it submits anything; the first is served whole, and the LLM serves on."""
    first, release, results = _held_generate(llm, [[1, 2, 3]] * 8)
    try:
        with pytest.raises(RuntimeError, match=r"^generate\(\) while another call runs on "
                                               "this LLM"):
            llm.generate([[4, 5]], GREEDY)
        with pytest.raises(RuntimeError, match=r"^shutdown\(\) while another call runs"):
            llm.shutdown()
    finally:
        release.set()
        first.join(60)
        del llm._drive
    outs, = results
    assert len(outs) == 8 and all(o.error is None and len(o.token_ids) == 3 for o in outs)
    assert not llm.controller.outputs and not llm._extras and not llm.controller.requests
    again, = llm.generate([[4, 5]], GREEDY)
    assert again.error is None and len(again.token_ids) == 3


@pytest.mark.timeout(120)
def test_leaving_a_with_block_while_another_thread_generates_waits_and_keeps_the_error(
        tiny_dir):
    """A reviewer's finding: `__exit__` raised the busy error over the block's own exception
    (kept only as its context) and left the engine open. It now waits for the other call,
    shuts down, and the block's error is the one raised."""
    import threading

    with pytest.raises(ValueError, match="^the block's own error$"):
        with LLM(tiny_dir, max_model_len=64) as engine:
            worker, release, results = _held_generate(engine, [[1, 2, 3]] * 2)
            threading.Timer(0.5, release.set).start()
            raise ValueError("the block's own error")
    worker.join(60)
    outs, = results
    assert all(o.error is None and len(o.token_ids) == 3 for o in outs)
    assert engine._closed and engine._closed_by == "shut down"
    assert multiprocessing.active_children() == []


def test_a_prompt_matrix_inside_the_list_is_named_on_one_line(llm):
    """A reviewer's finding: its error repeated numpy's repr, one line per row."""
    bad, good = llm.generate([np.ones((3, 3), dtype=int), [1, 2, 3]], GREEDY)
    assert str(bad.error).startswith("prompt array([[1, 1, 1], [1, 1, 1], ")
    assert "\n" not in str(bad.error) and good.error is None
