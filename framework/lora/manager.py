"""The worker's adapters: slots on the device, a host cache, and each step's token -> slot map.

`LoRAState` is shared by the model's LoRA layers (models/layers/lora.py) and the runner:
the layers allocate `max_loras` slots of rank `max_rank` when the model is built; before
a step that runs adapters the runner sets `token_slots` (one slot per token, -1 for the
base model) and every layer adds its term through the `lora_linear` op.

`LoRAManager` decides what is resident:
- an adapter a step needs is written into a free slot, else into the least recently
  used slot no request of this step needs (the scheduler admits at most `max_loras`
  adapters among running requests, so one always exists);
- adapters read from disk stay in host memory, at most `max_cpu_loras` of them (least
  recently used first out); an evicted slot reloads from there, or from the files.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .peft_adapter import LoRAAdapter, LoRALoadError, load_peft_adapter
from .request import LoRARequest

logger = logging.getLogger("portaserve")


class LoRAState:
    """What the LoRA layers share (see the module docstring)."""

    def __init__(self, max_loras: int, max_rank: int) -> None:
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers: list[Any] = []  # LinearLoRA, registered as the model is built
        self.token_slots: torch.Tensor | None = None
        self.op: Callable | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        #: the architecture's adaptable modules (ModelArchitecture.lora_modules); None: any
        self.modules: frozenset[str] | None = None

    def bind(self, ctx: Any) -> None:
        """Take the op, dtype and device of the model being built (its LayerContext)."""
        self.op = ctx.ops.get("lora_linear")
        self.dtype = ctx.dtype
        self.device = ctx.device

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Every adaptable module of the model: checkpoint name -> (in, out), full sizes."""
        out: dict[str, tuple[int, int]] = {}
        for layer in self.layers:
            out.update(layer.shapes())
        return out


class LoRAManager:
    def __init__(self, state: LoRAState, max_cpu_loras: int | None = None) -> None:
        self.state = state
        self.max_cpu_loras = max(max_cpu_loras or state.max_loras, state.max_loras)
        self._shapes = state.shapes()
        self._slots: list[int | None] = [None] * state.max_loras  # slot -> adapter id
        self._lru: OrderedDict[int, None] = OrderedDict()  # resident adapter ids, least recent first
        self._host: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.requests: dict[int, LoRARequest] = {}
        self.num_loads = 0
        self.num_evictions = 0

    def remember(self, request: LoRARequest) -> None:
        old = self.requests.get(request.lora_int_id)
        if old is not None and old.lora_path != request.lora_path:
            self.forget(request.lora_int_id)  # the same id for new files: reload
        self.requests[request.lora_int_id] = request

    def forget(self, lora_id: int) -> None:
        """Drop an adapter everywhere (unloaded): its slot frees, its host copy goes."""
        self._host.pop(lora_id, None)
        if lora_id in self._lru:
            del self._lru[lora_id]
            self._slots[self._slots.index(lora_id)] = None

    def _host_copy(self, lora_id: int) -> LoRAAdapter:
        adapter = self._host.get(lora_id)
        if adapter is not None:
            self._host.move_to_end(lora_id)
            return adapter
        request = self.requests.get(lora_id)
        if request is None:
            raise LoRALoadError(f"adapter id {lora_id} is not known to this worker")
        adapter = load_peft_adapter(request.lora_name, lora_id, request.lora_path, self.state.max_rank, self._shapes)
        self._host[lora_id] = adapter
        # least recently used first, but never an adapter resident in a slot
        for old in [i for i in self._host if i not in self._lru and i != lora_id]:
            if len(self._host) <= self.max_cpu_loras:
                break
            del self._host[old]
        return adapter

    def validate(self, request: LoRARequest) -> None:
        """Read and check an adapter (a load error names the tensor); nothing is changed."""
        load_peft_adapter(request.lora_name, request.lora_int_id, request.lora_path, self.state.max_rank, self._shapes)

    def activate(self, lora_ids: Iterable[int]) -> tuple[dict[int, int], dict[int, str]]:
        """Make the adapters of a step resident: (adapter id -> slot, adapter id -> why it
        could not be loaded: its files changed or went since the front end checked them;
        its requests fail, the others run)."""
        wanted = list(dict.fromkeys(i for i in lora_ids if i))
        if len(wanted) > self.state.max_loras:
            raise RuntimeError(f"a step needs {len(wanted)} adapters; --max-loras is {self.state.max_loras}")
        mapping: dict[int, int] = {}
        failures: dict[int, str] = {}
        for lora_id in wanted:
            if lora_id in self._lru:
                self._lru.move_to_end(lora_id)
                mapping[lora_id] = self._slots.index(lora_id)
                continue
            slot = self._free_slot(set(wanted))  # first: an adapter leaving its slot may leave the host too
            try:
                adapter = self._host_copy(lora_id)
            except Exception as exc:  # noqa: BLE001 - any read error fails the adapter's requests alone
                failures[lora_id] = f"the LoRA adapter could not be loaded: {exc}"
                continue
            for layer in self.state.layers:
                layer.set_slot(slot, adapter.weights)
            self._slots[slot] = lora_id
            self._lru[lora_id] = None
            self.num_loads += 1
            mapping[lora_id] = slot
        return mapping, failures

    def _free_slot(self, keep: set[int]) -> int:
        if None in self._slots:
            return self._slots.index(None)
        victim = next(i for i in self._lru if i not in keep)
        del self._lru[victim]
        self.num_evictions += 1
        logger.debug("LoRA: evicting adapter %d from its slot", victim)
        slot = self._slots.index(victim)
        self._slots[slot] = None
        return slot

    def resident(self) -> list[int]:
        return list(self._lru)
