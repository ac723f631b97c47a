"""A minimal synchronous driver for protocol unit tests: ops are recorded, results are canned."""

from protocol.commands import AllocateKV
from protocol.controller import Abort, Broadcast, Controller, Done, Idle
from protocol.eligibility import GraphPlan
from protocol.errors import ProtocolError
from protocol.keys import SHORT
from protocol.worker import Worker


class FakeBackend:
    """Records ops; returns plausible values (bytes, tokens)."""

    def __init__(self, rank, fail_on=None, free_bytes=10**12):
        self.rank = rank
        self.free_bytes = free_bytes
        self.log = []
        self.graph_bytes = 0
        self.fail_on = fail_on

    def run(self, op):
        self.log.append(op)
        if self.fail_on and op.name == self.fail_on:
            raise ProtocolError(f"boom in {op.name}")
        if op.name == "profile_memory":
            return (self.free_bytes, 0 if self.free_bytes < 10**6 else 10**6)
        if op.name == "record":
            self.graph_bytes += 100
        if op.name == "free_graphs":
            self.graph_bytes = 0
        if op.name == "graph_memory":
            return self.graph_bytes
        if op.name == "read_tokens":
            step = op.args[0]
            return (7,) * (len(step.rows) + len(step.admits))  # slot order: rows, admissions
        return None


class PagedBackend(FakeBackend):
    """A fake rank with a modelled paged KV cache: tokens are stored per page, and the sampled
    token is a hash of the sequence read back through the slot's page table -- so a wrong page
    id, a stale page or a lost page-table row changes the tokens, as it would on a device.

    Args:
        rank: the rank.
        pages: KV pages the memory report makes the controller allocate.
        vocab: modelled vocabulary size.
    """

    GRAPHS = 100

    def __init__(self, rank, pages, vocab=97):
        super().__init__(rank)
        self.pages, self.vocab = pages, vocab
        self.page_size = None
        self.kv: dict[int, dict[int, int]] = {}      # page -> {offset: token}
        self.table: dict[int, dict[int, int]] = {}   # slot -> {page index: page}
        self.device_ids: tuple[int, ...] = ()        # overlap: the last sampled ids, on device
        self.sampled: dict[int, tuple[int, ...]] = {}  # overlap: step seq -> its ids, unread

    def _write(self, slot, position, token):
        page = self.table[slot][position // self.page_size]
        self.kv.setdefault(page, {})[position % self.page_size] = token

    def _next(self, slot, length):
        seq = tuple(self.kv[self.table[slot][p // self.page_size]][p % self.page_size]
                    for p in range(length))
        return hash(seq) % self.vocab

    def run(self, op):
        if op.name == "profile_memory":
            return ((self.pages + 1) * PAGE_BYTES + 10**6 + 4 * self.GRAPHS, 10**6)
        if op.name == "record":
            self.graph_bytes += self.GRAPHS
            return None
        if op.name == "allocate_kv":
            assert op.args[0] == self.pages
            return None
        if op.name == "release_slot":
            self.table.pop(op.args[0], None)
        elif op.name == "move_slot":
            src, dst = op.args
            self.table[dst] = self.table.pop(src)
        elif op.name == "assign_pages":
            slot, first, pages = op.args
            row = self.table.setdefault(slot, {})
            assert sorted(row) == list(range(first))
            row.update({first + i: p for i, p in enumerate(pages)})
        elif op.name == "prefill":
            self.out = {}
            admits, chunk = op.args
            for admit in admits:  # a last chunk writes only prompt[start:], after the cache
                for position in range(admit.start, len(admit.prompt)):
                    self._write(admit.slot, position, admit.prompt[position])
                self.out[admit.slot] = self._next(admit.slot, len(admit.prompt))
            if chunk is not None:
                for i, token in enumerate(chunk.tokens):
                    self._write(chunk.slot, chunk.start + i, token)
        elif op.name in ("run_eager", "prepare_replay"):
            step = op.args[0]
            self.out = getattr(self, "out", {}) if step.admits else {}
            for i, row in enumerate(step.rows):
                # overlapped scheduling: the input token is the previous step's sampled id,
                # read "on the device" at the index the step's feed names
                token = row.token if step.feed is None else self.device_ids[step.feed[i]]
                self._write(row.slot, row.position, token)
                self.out[row.slot] = self._next(row.slot, row.position + 1)
        elif op.name == "enqueue_sample" and op.args[0].overlap:
            step, out = op.args[0], self.out
            self.out = {}
            self.device_ids = tuple(out[slot] for slot in range(len(out)))
            self.sampled[step.seq] = self.device_ids
        elif op.name == "read_tokens":
            step = op.args[0]
            if step.overlap:
                return self.sampled.pop(step.seq)
            out, self.out = self.out, {}
            return tuple(out[slot] for slot in range(len(out)))  # slot order
        return super().run(op)


class ShortTileBackend(PagedBackend):
    """`PagedBackend` whose replay of a `SHORT` graph reads only the first ``short_context``
    cached tokens of each row, as the short path's one tile does (`protocol.keys.SHORT`): a
    step replayed on it while a row's context is longer samples another token for that row.
    Its memory report makes room for ``graphs`` graphs (both paths' keys) beside the pages.

    Args:
        rank: the rank.
        pages: KV pages the memory report makes the controller allocate.
        short_context: the tile (tokens), or None with the short path off.
        graphs: graphs the plan keeps (`GraphPlan.keys`).
    """

    def __init__(self, rank, pages, short_context, graphs):
        super().__init__(rank, pages)
        self.short_context, self.graphs = short_context, graphs
        self._tile = None

    def _next(self, slot, length):
        return super()._next(slot, length if self._tile is None else min(length, self._tile))

    def run(self, op):
        if op.name == "profile_memory":
            return ((self.pages + 1) * PAGE_BYTES + 10**6 + self.graphs * self.GRAPHS, 10**6)
        if op.name == "prepare_replay" and op.args[0].key is not None \
                and op.args[0].key.path == SHORT:
            self._tile = self.short_context
            try:
                return super().run(op)
            finally:
                self._tile = None
        return super().run(op)


PAGE_BYTES = 1000
"""kv_page_bytes of the configurations `PagedBackend` serves."""


def deliver(ctrl, workers, backends, command) -> None:
    """One broadcast: every rank's worker runs `command`'s ops on its backend (a paged backend
    first learns the page size an `AllocateKV` names) and the controller takes each reply, a
    rank's `ProtocolError` as its failure reply."""
    for worker, backend in zip(workers, backends):
        if isinstance(command, AllocateKV) and isinstance(backend, PagedBackend):
            backend.page_size = command.page_size
        try:
            reply = worker.reply(command, [backend.run(op) for op in worker.ops_for(command)])
        except ProtocolError as exc:
            reply = worker.fail(command, exc)
        ctrl.on_reply(reply)


def drive(config, requests=(), fail=None, max_iter=10_000, backends=None, pages_per_seq=1,
          free_bytes=10**12, after_reply=None):
    """Run controller + workers to Done or Abort. ``fail`` = (rank, op name); ``backends``
    replaces the default `FakeBackend` per rank; ``free_bytes``: what each default rank
    reports free; ``after_reply(ctrl, command)`` runs once every rank replied to a command."""
    ctrl = Controller(config, pages_per_seq=pages_per_seq)
    workers = [Worker(r, config.world_size, GraphPlan.from_config(config), config.max_batch)
               for r in range(config.world_size)]
    backends = backends or [FakeBackend(r, fail[1] if fail and fail[0] == r else None, free_bytes)
                            for r in range(config.world_size)]
    sent = []
    pending = list(requests)
    for _ in range(max_iter):
        action = ctrl.next_action()
        if isinstance(action, (Done, Abort)):
            return ctrl, workers, backends, sent, action
        if isinstance(action, Idle):
            if pending:
                while pending:
                    ctrl.submit(pending.pop(0))
            else:
                ctrl.shutdown()
            continue
        assert isinstance(action, Broadcast)
        sent.append(action.command)
        deliver(ctrl, workers, backends, action.command)
        if after_reply is not None:
            after_reply(ctrl, action.command)
    raise AssertionError("driver did not finish")
