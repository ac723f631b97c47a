"""Where spawned ranks meet: a torch.distributed TCPStore that the spawning process holds.

Choosing a free port by binding port 0, closing the socket and handing the number to the
ranks leaves a window, the ranks' start (seconds of imports), in which any other process may
bind that port: rank 0's store then fails to bind, or the ranks join a store that another
group of ranks owns. Parallel test workers that each start ranks make that likelier. Here the
spawning process starts the store's server on a port the operating system picks and keeps it
bound until its ranks are gone, and the ranks connect to it as clients, so the port is never
free between its choice and the rendezvous.
"""

from __future__ import annotations

import dataclasses
import datetime

HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class StoreAddress:
    """Host and TCP port of a held store's server (picklable: it travels to spawned ranks)."""

    host: str
    port: int


class HeldStore:
    """A TCPStore server on a port the OS picks (port 0), open from construction to `close`.
    torch's server listens on every interface; the ranks reach it through loopback (HOST).
    The spawning process makes no store operation of its own; each rank's client takes its
    own timeout (`join_process_group`).

    Raises:
        RuntimeError (torch's DistNetworkError): the server could not start.
    """

    def __init__(self):
        import torch.distributed as dist

        self._server = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False)
        self.address = StoreAddress(HOST, self._server.port)

    def close(self) -> None:
        """Stop the server (dropping the last reference to a TCPStore closes its socket)."""
        self._server = None


def join_process_group(backend: str, address: StoreAddress, rank: int, world_size: int,
                       timeout: datetime.timedelta, **kwargs) -> None:
    """Initialise torch.distributed's default group through the held store at `address`, as
    one of `world_size` ranks; `kwargs` go to `torch.distributed.init_process_group`.

    Raises:
        RuntimeError (torch's DistStoreError / DistNetworkError): the other ranks did not join
            within `timeout`, or the store was unreachable (torch retries a failed connect, so
            that takes up to about twice `timeout`).
    """
    import torch.distributed as dist

    store = dist.TCPStore(address.host, address.port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout, **kwargs)
