"""``StepContractConnector``: checks that an engine keeps kvconn's worker step contract.

Load it beside other connectors (``"kvconn.testing.step_contract:StepContractConnector"``)
in any engine kvconn runs in. Its worker side records each hook call and raises
:class:`StepContractError` at the first call out of the order that
:mod:`kvconn.hookspecs` guarantees, so under ``on_error="raise"`` a broken
engine adapter stops the run with the step and the calls that broke it. It
saves and loads nothing; its scheduler side sends metadata every step, since
the per-step hooks are owed only to connectors with metadata.
"""

from __future__ import annotations

from typing import Any

from .. import KVConnector, KVConnectorBlockState, KVConnectorMetadata, SchedulerOutput

__all__ = ["StepContractConnector", "StepContractError", "StepContractMetadata"]


class StepContractError(AssertionError):
    """An engine called a worker hook out of the contract's order."""


class StepContractMetadata(KVConnectorMetadata):
    step: int = 0


class StepContractConnector(KVConnector):
    """Raises on the first worker hook called out of the step contract's order."""

    Metadata = StepContractMetadata

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps = 0
        self._calls: list[str] = []  # this step's calls so far
        self._layers: set[str] = set()

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, block_state: KVConnectorBlockState
    ) -> StepContractMetadata:
        return StepContractMetadata(step=scheduler_output.step)

    def _expect(self, call: str, allowed_after: set[str | None]) -> None:
        last = self._calls[-1] if self._calls else None
        self._calls.append(call)
        if last not in allowed_after:
            raise StepContractError(
                f"worker step contract broken in step {self.steps + 1}: {call!r} after {self._calls[:-1]}"
            )

    def start_load_kv(self, metadata: StepContractMetadata) -> None:
        self._expect("start_load_kv", {None})

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._expect(f"wait_for_layer_load:{layer_name}", {"start_load_kv", "save_kv_layer"})
        self._layers.add(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, metadata: StepContractMetadata) -> None:
        self._expect("save_kv_layer", {f"wait_for_layer_load:{layer_name}"})

    def wait_for_save(self) -> None:
        self._expect("wait_for_save", {"start_load_kv", "save_kv_layer"})

    def get_finished(self) -> None:
        self._expect("get_finished", {"wait_for_save"})

    def get_block_ids_with_load_errors(self) -> None:
        self._expect("get_block_ids_with_load_errors", {"get_finished"})

    def get_kv_connector_stats(self) -> dict[str, float]:
        self._expect("get_kv_connector_stats", {"get_block_ids_with_load_errors"})
        self.steps += 1
        self._calls = []
        # A counter (summed by engines) and a private gauge (the layers seen so far, not summed).
        return {"contract_steps": 1.0, "_contract_layers_seen": float(len(self._layers))}
