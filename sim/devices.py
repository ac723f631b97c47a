"""Devices and collectives: kernels leave the streams here.

A compute kernel at the head of a stream runs on its own; a collective completes only when every
rank's device has the matching collective at the head of a stream (H3), and a mismatch of
signature is a divergence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sim.common import Outcome, sig_text as _sig_text, token_fn

if TYPE_CHECKING:
    from sim.world import Device


class DeviceModel:
    """Mixin of `sim.world.World`: device and collective actors."""


    def _device_ready(self, r: int) -> bool:
        dev = self.devices[r]
        if (dev.main and dev.main[0][0] == "k") or (dev.side and dev.side[0][0] == "k"):
            return True
        if not self.hz.h3_spinning_collectives and dev.collective_head() is not None:
            return True
        return False

    def _step_device(self, r: int) -> None:
        dev = self.devices[r]
        stream = dev.main if dev.main and dev.main[0][0] == "k" else (
            dev.side if dev.side and dev.side[0][0] == "k" else None)
        if stream is None:
            stream = dev.collective_head()
            kernel = stream.pop(0)
            dev.completed_collectives += 1
            self._ev(f"device{r}", "collective", kernel[2][3], rank=r, detail=_sig_text(kernel))
            return
        kernel = stream.pop(0)
        self._execute_kernel(r, dev, kernel)

    def _execute_kernel(self, r: int, dev: Device, kernel: tuple) -> None:
        label = kernel[1]
        vocab = self.scenario.vocab
        if label == "meta":
            dev.meta = (kernel[2], kernel[3])
        elif label == "decode":
            for row in kernel[3]:
                dev.out[row.request_id] = (kernel[2], token_fn(row.request_id, row.position, row.token, vocab))
        elif label == "replay":
            seq = kernel[3]
            _, rows = dev.meta
            for row in rows:
                dev.out[row.request_id] = (seq, token_fn(row.request_id, row.position, row.token, vocab))
        elif label == "prefill":
            for admit in kernel[2]:
                dev.out[admit.request_id] = (
                    kernel[3], token_fn(admit.request_id, len(admit.prompt) - 1, admit.prompt[-1], vocab))
        else:
            handler = self.variant.sim_kernels.get(label)
            if handler is not None:
                handler(self, r, dev, kernel)

    def _collective_ready(self):
        if not self.hz.h3_spinning_collectives:
            return None
        heads = []
        for device in self.devices:
            head = device.collective_head()
            if head is None:
                return None
            heads.append(head)
        return heads

    def _step_collective(self) -> None:
        heads = self._collective_ready()
        kernels = [h[0] for h in heads]
        sigs = {k[2][:3] for k in kernels}
        seqs = {k[1] for k in kernels}
        if len(sigs) > 1 or len(seqs) > 1:
            lines = "; ".join(f"rank {r} is in {_sig_text(k)}" for r, k in enumerate(kernels))
            self.outcome = Outcome("divergence",
                                   f"collective sequences differ across ranks: {lines}", "I2")
            return
        for h in heads:
            h.pop(0)
        for d in self.devices:
            d.completed_collectives += 1
        self._ev("collectives", "collective", kernels[0][2][3], detail=_sig_text(kernels[0]))

