"""The decode layer's kernels, read from their source (`engine.kernels.pdl_order`), obey the
PDL rule of `engine.kernels.pdl` in every order the hardware allows (`sim.launch_chain`); a
kernel mutated to load its predecessor's output before its wait is caught."""

from __future__ import annotations

import inspect

import pytest

from engine.kernels import attention_oproj, decode_attention, fused, pdl_order, skinny_gemm
from sim.launch_chain import AT_EXIT, KernelSpec, check_chain

# Each launch of the fused decode layer (engine.model.Qwen3DecoderLayer.forward_fused): the
# kernel and what buffer each pointer parameter is at that call site.
GEMM_WS = {"part_ptr": "gemm partials", "count_ptr": "gemm counters", "stats_ptr": "row stats"}
ATTN_WS = {"acc_ptr": "split partials", "stats_ptr": "split stats", "count_ptr": "split counters"}


HEAD_PTRS = ("qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "pos_ptr", "slot_ptr", "pt_ptr",
             "kc_ptr", "vc_ptr")
ATTEND_PTRS = ("o_ptr", "lens_ptr", "group_count_ptr")


def gemm(x: str, w: str, out: str) -> dict:
    """A skinny GEMM launch without the rope epilogue: its head pointers are the weight
    (`skinny_gemm._head_args`)."""
    return {"x_ptr": x, "x_desc": x, "w_ptr": w, "w_desc": w, "out_ptr": out, **GEMM_WS,
            **dict.fromkeys(HEAD_PTRS + ATTEND_PTRS, w)}


def rope_buffers(i: int) -> dict:
    return {"qw_ptr": f"q_norm {i}", "kw_ptr": f"k_norm {i}", "cos_ptr": "cos",
            "sin_ptr": "sin", "pos_ptr": "positions", "slot_ptr": "slot_ids",
            "pt_ptr": "page_table", "kc_ptr": f"k_cache {i}", "vc_ptr": f"v_cache {i}"}


def layer(i: int, rope: bool = False, short: bool = False, tail: bool = False
          ) -> list[tuple[str, object, dict]]:
    # layer 0 normalises the embedding first; later layers' QKV folds the norm in. With
    # `rope` the QKV GEMM also does the q/k norm + RoPE + KV write (FusedLayerPlan.rope); with
    # `short` (and rope) attention and o_proj are one launch (engine.kernels.attention_oproj);
    # with `tail` (and rope) the QKV launch attends in its tail (skinny_gemm.AttendTail).
    first = [(f"input norm {i}", fused._add_rms_norm_kernel,
              {"x_ptr": "residual", "res_ptr": "residual", "w_ptr": f"input_norm {i}",
               "out_ptr": "normed"})] if i == 0 else []
    x = "normed" if i == 0 else "residual"
    if tail:
        return first + [
            (f"qkv+attention {i}", skinny_gemm._skinny_gemm_kernel,
             {"x_ptr": x, "x_desc": x, "w_ptr": f"w_qkv {i}", "w_desc": f"w_qkv {i}",
              "out_ptr": "q", **GEMM_WS, **rope_buffers(i), "o_ptr": "attn_out",
              "lens_ptr": "seq_lens", "group_count_ptr": "group counters"}),
            (f"o_proj {i}", skinny_gemm._skinny_gemm_kernel,
             gemm("attn_out", f"w_o {i}", "residual")),
            (f"gate_up {i}", skinny_gemm._skinny_gemm_kernel,
             gemm("residual", f"w_gate_up {i}", "act")),
            (f"down {i}", skinny_gemm._skinny_gemm_kernel, gemm("act", f"w_down {i}", "residual")),
        ]
    if rope:
        qkv = [(f"qkv {i}", skinny_gemm._skinny_gemm_kernel,
                {"x_ptr": x, "x_desc": x, "w_ptr": f"w_qkv {i}", "w_desc": f"w_qkv {i}",
                 "out_ptr": "q",
                 **GEMM_WS,
                 **rope_buffers(i), **dict.fromkeys(ATTEND_PTRS, f"w_qkv {i}")})]
    else:
        qkv = [(f"qkv {i}", skinny_gemm._skinny_gemm_kernel, gemm(x, f"w_qkv {i}", "qkv")),
               (f"q/k norm {i}", fused._qk_norm_rope_kv_kernel,
                {"qkv_ptr": "qkv", "q_ptr": "q", **rope_buffers(i)})]
    if short:
        return first + qkv + [
            (f"attention+o_proj {i}", attention_oproj._attn_oproj_kernel,
             {"q_ptr": "q", "k_ptr": f"k_cache {i}", "v_ptr": f"v_cache {i}",
              "pt_ptr": "page_table", "lens_ptr": "seq_lens", "slots_ptr": "slot_ids",
              "w_ptr": f"w_o {i}", "out_ptr": "residual", "part_ptr": "short partials",
              "count_ptr": "short counters", "stats_ptr": "row stats"}),
            (f"gate_up {i}", skinny_gemm._skinny_gemm_kernel,
             gemm("residual", f"w_gate_up {i}", "act")),
            (f"down {i}", skinny_gemm._skinny_gemm_kernel, gemm("act", f"w_down {i}", "residual")),
        ]
    return first + qkv + [
        (f"attention {i}", decode_attention._paged_decode_kernel,
         {"q_ptr": "q", "k_ptr": f"k_cache {i}", "v_ptr": f"v_cache {i}",
          "pt_ptr": "page_table", "lens_ptr": "seq_lens", "slots_ptr": "slot_ids",
          "out_ptr": "attn_out", "order_ptr": "row_order", **ATTN_WS}),
        (f"o_proj {i}", skinny_gemm._skinny_gemm_kernel, gemm("attn_out", f"w_o {i}", "residual")),
        (f"gate_up {i}", skinny_gemm._skinny_gemm_kernel, gemm("residual", f"w_gate_up {i}", "act")),
        (f"down {i}", skinny_gemm._skinny_gemm_kernel, gemm("act", f"w_down {i}", "residual")),
    ]


# Before layer 0: the step's host-to-device copy and torch's kernels, launched without PDL and
# never triggering early (a kernel that does not call launch_dependents triggers at exit).
STEP_START = [
    KernelSpec("copy replay inputs", pdl=False, trigger=AT_EXIT,
               writes=frozenset({"input_ids", "positions", "slot_ids", "row_order",
                                 "page_table"})),
    KernelSpec("seq_lens index_copy", pdl=False, trigger=AT_EXIT,
               reads_after_wait=frozenset({"positions", "slot_ids"}),
               writes=frozenset({"seq_lens"})),
    KernelSpec("embedding", pdl=False, trigger=AT_EXIT, reads_after_wait=frozenset({"input_ids"}),
               writes=frozenset({"residual"})),
]


def spec(name: str, order: pdl_order.MemoryOrder, buffers: dict) -> KernelSpec:
    def named(params):
        missing = set(params) - set(buffers)
        assert not missing, f"{name}: no buffer named for {sorted(missing)}"
        return frozenset(buffers[p] for p in params)

    return KernelSpec(name, True, named(order.loads_before_wait),
                      named(order.loads_after_wait), named(order.stores - order.stores_before_wait),
                      order.trigger, named(order.stores_before_wait))


def decode_chain(sources: dict | None = None, rope: bool = False,
                 short: bool = False, tail: bool = False) -> list[KernelSpec]:
    """Step start, then two fused layers (6 launches; with `rope` 5; with `short` or `tail`
    4); `sources` replaces a kernel's source text."""
    sources = sources or {}
    chain = list(STEP_START)
    for name, kernel, buffers in layer(0, rope, short, tail) + layer(1, rope, short, tail):
        order = pdl_order.memory_order(sources.get(kernel, kernel), kernel.fn.__globals__)
        chain.append(spec(name, order, buffers))
    return chain


def source(kernel) -> str:
    return inspect.getsource(kernel.fn)


def test_every_pdl_kernel_of_the_decode_layer_waits_before_it_triggers():
    for kernel in (skinny_gemm._skinny_gemm_kernel, fused._qk_norm_rope_kv_kernel,
                   decode_attention._paged_decode_kernel, fused._add_rms_norm_kernel,
                   fused._silu_mul_kernel, attention_oproj._attn_oproj_kernel):
        order = pdl_order.memory_order(kernel)
        assert order.waits and order.trigger == "after wait", (kernel.fn.__name__, order)


def test_the_shipped_decode_layer_has_no_stale_read_in_any_order():
    chain = decode_chain()
    res = check_chain(chain)
    assert res.stale is None, str(res.stale)
    assert res.overlapped and res.states > len(chain)
    # what the shipped kernels load before their wait, as read from the source
    by_name = {k.name: k for k in chain}
    assert by_name["q/k norm 0"].reads_before_wait == {
        "positions", "slot_ids", "page_table", "q_norm 0", "k_norm 0", "cos", "sin"}
    assert by_name["o_proj 0"].reads_before_wait == {"w_o 0"}
    assert by_name["attention 0"].reads_before_wait == {
        "row_order", "slot_ids", "seq_lens"}


def test_the_five_launch_layer_has_no_stale_read_in_any_order():
    """The QKV GEMM with the q/k norm + RoPE + KV write in its epilogue loads, before its
    wait, what the q/k norm kernel did, and the attention right after it waits for its q and
    cache entries."""
    chain = decode_chain(rope=True)
    res = check_chain(chain)
    assert res.stale is None, str(res.stale)
    assert res.overlapped and res.states > len(chain)
    by_name = {k.name: k for k in chain}
    assert "q/k norm 0" not in by_name
    assert by_name["qkv 1"].reads_before_wait == {
        "w_qkv 1", "positions", "slot_ids", "page_table", "q_norm 1", "k_norm 1", "cos", "sin"}
    assert {"q", "k_cache 1", "v_cache 1"} <= by_name["qkv 1"].writes


def test_the_four_launch_layer_has_no_stale_read_in_any_order():
    """Attention fused into o_proj loads, before its wait, the o_proj weight and the step's
    slots, lengths and page-table entries; q and the cache entries the rope QKV GEMM just
    wrote only after it."""
    chain = decode_chain(rope=True, short=True)
    res = check_chain(chain)
    assert res.stale is None, str(res.stale)
    assert res.overlapped and res.states > len(chain)
    by_name = {k.name: k for k in chain}
    assert "attention 1" not in by_name and "o_proj 1" not in by_name
    assert by_name["attention+o_proj 1"].reads_before_wait == {
        "w_o 1", "slot_ids", "seq_lens", "page_table"}
    assert {"q", "k_cache 1", "v_cache 1", "residual"} <= by_name[
        "attention+o_proj 1"].reads_after_wait


def test_the_layer_attending_in_the_qkv_tail_has_no_stale_read_in_any_order():
    """The QKV launch that attends in its tail loads, before its wait, what the rope epilogue
    does; the o_proj after it reads the attention output only after its own wait."""
    chain = decode_chain(tail=True)
    res = check_chain(chain)
    assert res.stale is None, str(res.stale)
    assert res.overlapped and res.states > len(chain)
    by_name = {k.name: k for k in chain}
    assert by_name["qkv+attention 1"].reads_before_wait == {
        "w_qkv 1", "positions", "slot_ids", "page_table", "q_norm 1", "k_norm 1", "cos", "sin"}
    assert {"attn_out", "q", "k_cache 1", "v_cache 1", "group counters"} <= by_name[
        "qkv+attention 1"].writes
    assert "attn_out" in by_name["o_proj 1"].reads_after_wait


@pytest.mark.parametrize("line, buffer", [
    ("        t = tl.arange(0, BLOCK_T)\n", "q"),
    ("        lens = tl.minimum(lens, BLOCK_T)\n", "k_cache 0"),
])
def test_the_fused_attention_loading_the_previous_launchs_writes_early_is_caught(line, buffer):
    src = source(attention_oproj._attn_oproj_kernel)
    ptr = {"q": "q_ptr", "k_cache 0": "k_ptr"}[buffer]
    mutated = src.replace(line, line + f"        _x = tl.load({ptr} + m)\n", 1)
    assert mutated != src, "the mutation did not apply"
    res = check_chain(decode_chain({attention_oproj._attn_oproj_kernel: mutated}, rope=True,
                                   short=True))
    assert res.stale is not None, "the mutant survived"
    assert (res.stale.reader, res.stale.buffer) == ("attention+o_proj 0", buffer), str(res.stale)


def test_a_rope_epilogue_reading_the_row_statistics_before_the_wait_is_caught():
    """The statistics a normed GEMM reads are the previous launch's (o_proj's or down's
    residual epilogue): a load of them among the rope epilogue's loads before the wait is a
    stale read. The reading does not resolve constexpr branches, so the first launch hit is
    the first normed GEMM after a residual one (gate_up 0), HEADS or not."""
    src = source(skinny_gemm._skinny_gemm_kernel)
    mutated = src.replace("            is_q = pid_n < NQ\n",
                          "            is_q = pid_n < NQ\n            _s = tl.load(stats_ptr)\n", 1)
    assert mutated != src, "the mutation did not apply"
    res = check_chain(decode_chain({skinny_gemm._skinny_gemm_kernel: mutated}, rope=True))
    assert res.stale is not None, "the mutant survived"
    assert (res.stale.reader, res.stale.buffer) == ("gate_up 0", "row stats"), str(res.stale)


MUTANTS = [
    # q loaded before the wait: q/k norm (the rope QKV GEMM), the launch just before, writes it
    (decode_attention._paged_decode_kernel,
     lambda s: s.replace("        b = tl.program_id(0)\n",
                         "        b = tl.program_id(0)\n        _q = tl.load(q_ptr)\n", 1),
     "attention 0", "q"),
    # K read with the lengths, before the wait: the launch just before writes the new
    # token's K into the cache
    (decode_attention._paged_decode_kernel,
     lambda s: s.replace("        length = tl.load(lens_ptr + slot, cache_modifier=\".cg\")\n",
                         "        length = tl.load(lens_ptr + slot, cache_modifier=\".cg\")\n"
                         "        _k = tl.load(k_ptr + slot)\n", 1),
     "attention 0", "k_cache 0"),
    # no wait at all: the skinny GEMM's x is the previous launch's output (the first one hit
    # is layer 0's QKV over the input norm's output)
    (skinny_gemm._skinny_gemm_kernel,
     lambda s: s.replace("tl.extra.cuda.gdc_wait()", "pass"), "qkv 0", "normed"),
    # an x_tma tile's first activation tile read with the one-tile weights, before the wait
    (skinny_gemm._skinny_gemm_kernel,
     lambda s: s.replace("                wt = w_desc.load([row0, k_begin])\n",
                         "                wt = w_desc.load([row0, k_begin])\n"
                         "                _x = x_desc.load([0, k_begin])\n", 1),
     "qkv 0", "normed"),
    # the qkv row read before the wait
    (fused._qk_norm_rope_kv_kernel,
     lambda s: s.replace("        d = tl.arange(0, D)\n",
                         "        d = tl.arange(0, D)\n        _x = tl.load(qkv_ptr + t)\n", 1),
     "q/k norm 0", "qkv"),
]


@pytest.mark.parametrize("kernel, mutate, reader, buffer, rope", [
    pytest.param(*m, rope, id=f"{m[2]}-{5 if rope else 6} launches")
    for m in MUTANTS for rope in (False, True)
    if not (rope and m[0] is fused._qk_norm_rope_kv_kernel)])  # not in the 5-launch layer
def test_a_load_of_the_previous_launchs_output_moved_before_the_wait_is_caught(
        kernel, mutate, reader, buffer, rope):
    mutated = mutate(source(kernel))
    assert mutated != source(kernel), "the mutation did not apply"
    res = check_chain(decode_chain({kernel: mutated}, rope=rope))
    assert res.stale is not None, "the mutant survived"
    assert (res.stale.reader, res.stale.buffer) == (reader, buffer), str(res.stale)


def test_a_trigger_moved_before_the_wait_is_reported_by_the_reading():
    src = source(fused._qk_norm_rope_kv_kernel).replace(
        "            tl.extra.cuda.gdc_wait()\n            tl.extra.cuda.gdc_launch_dependents()\n",
        "            tl.extra.cuda.gdc_launch_dependents()\n            tl.extra.cuda.gdc_wait()\n")
    assert pdl_order.memory_order(src).trigger == "before wait"


def test_memory_order_follows_addresses_not_loaded_values():
    src = '''
def kern(a_ptr, b_ptr, c_ptr, PDL):
    i = tl.load(a_ptr)            # a value: an index, not an address
    p = b_ptr + i
    if PDL:
        tl.extra.cuda.gdc_wait()
    x = tl.load(p).to(tl.float32)
    helper(c_ptr, x)              # a helper may load and store what it is handed
'''
    order = pdl_order.memory_order(src)
    assert order.loads_before_wait == {"a_ptr"}
    assert order.loads_after_wait == {"b_ptr", "c_ptr"}
    assert order.stores == {"c_ptr"} and order.trigger == "at exit"
    with pytest.raises(ValueError, match="no function definition"):
        pdl_order.memory_order("x = 1")


def test_memory_order_reads_keyword_addresses_and_refuses_unnamed_pointers():
    """A fresh user's findings: `tl.load(pointer=...)` was invisible, and a pointer parameter
    not named *_ptr was skipped."""
    src = """
def kern(q_ptr, o_ptr, PDL):
    x = tl.load(pointer=q_ptr + 1)
    if PDL:
        tl.extra.cuda.gdc_wait()
    tl.store(pointer=o_ptr, value=x)
"""
    order = pdl_order.memory_order(src)
    assert order.loads_before_wait == {"q_ptr"} and order.stores == {"o_ptr"}
    with pytest.raises(ValueError, match="line 2: tl.load of an address that derives from no"):
        pdl_order.memory_order("def kern(Q, o_ptr):\n    x = tl.load(Q)\n")


def test_a_tensor_descriptor_load_reads_the_tensor_the_descriptor_names():
    """`w_desc.load([row, col])` (a TMA tile's weight read) counts as a load of `w_desc`, at
    its place relative to the wait; a descriptor the reading cannot name is refused."""
    order = pdl_order.memory_order(skinny_gemm._skinny_gemm_kernel)
    assert "w_desc" in order.loads_before_wait  # the one-tile weight read, as with w_ptr
    # the activation is the previous launch's output: its descriptor reads follow the wait
    assert "x_desc" in order.loads_after_wait and "x_desc" not in order.loads_before_wait
    src = ("def k(a_desc, out_ptr):\n    tl.extra.cuda.gdc_wait()\n"
           "    t = a_desc.load([0, 0])\n    tl.store(out_ptr, t)\n")
    order = pdl_order.memory_order(src)
    assert order.loads_after_wait == {"a_desc"} and not order.loads_before_wait
    with pytest.raises(ValueError, match="derives from no pointer"):
        pdl_order.memory_order(src.replace("a_desc.load", "other.load"))


def _reads_only(table_ptr, i):
    return tl.load(table_ptr + i)  # only read as source, never run


def _writes_only(dst_ptr, value):
    tl.store(dst_ptr, value)  # only read as source


def _waits(a_ptr):
    tl.extra.cuda.gdc_wait()  # only read as source
    return tl.load(a_ptr)  # only read as source


def _loads_unnamed(a):
    return tl.load(a)  # only read as source


def test_a_helper_loads_and_stores_what_its_own_source_does():
    """A call of a helper of the kernel's module (by name or through a module) counts the
    helper's own loads and stores of the pointers it is handed (a table only read is not
    written); a helper whose source cannot be found may load and store everything it is
    handed; a helper that waits, or whose own reading fails, is refused naming it."""
    src = ("def k(t_ptr, o_ptr, PDL):\n    tl.extra.cuda.gdc_wait()\n"
           "    v = _reads_only(t_ptr, 3)\n    _writes_only(o_ptr, v)\n"
           "    _unknown(t_ptr)\n")
    order = pdl_order.memory_order(src.replace("    _unknown(t_ptr)\n", ""), globals())
    assert order.loads_after_wait == {"t_ptr"} and order.stores == {"o_ptr"}
    order = pdl_order.memory_order(src, globals())
    assert order.stores == {"o_ptr", "t_ptr"}
    # a helper named through its module is followed too
    import types

    module = types.ModuleType("helpers")
    module._reads_only = _reads_only
    order = pdl_order.memory_order(src.replace("_reads_only(", "helpers._reads_only(").replace(
        "    _unknown(t_ptr)\n", ""), {**globals(), "helpers": module})
    assert order.loads_after_wait == {"t_ptr"} and order.stores == {"o_ptr"}
    for helper, message in (("_waits", "helper _waits calls gdc_wait"),
                            ("_loads_unnamed", "helper _loads_unnamed: line 2: tl.load")):
        with pytest.raises(ValueError, match=message):
            pdl_order.memory_order(src.replace("_reads_only(t_ptr, 3)", f"{helper}(t_ptr)"),
                                   globals())
    # the QKV tail's attention reads the step's slots, lengths and page table, never writes them
    order = pdl_order.memory_order(skinny_gemm._skinny_gemm_kernel)
    assert {"o_ptr", "group_count_ptr", "kc_ptr", "vc_ptr", "out_ptr"} <= order.stores
    assert not {"slot_ptr", "lens_ptr", "pt_ptr"} & order.stores
    assert {"lens_ptr", "slot_ptr", "pt_ptr"} <= order.loads_after_wait
