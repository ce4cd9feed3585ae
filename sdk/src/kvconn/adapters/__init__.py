"""Engine adapters are separate distributions; this package keeps their old import paths.

An adapter hooks kvconn into an engine (vLLM's ``vllm.general_plugins`` entry
point, for one), so it ships on its own: installing a connector does not touch
an engine unless the adapter is installed too.

* :mod:`kvconn.adapters.vllm` — alias of :mod:`kvconn_vllm` (distribution
  ``kvconn-vllm``), so ``kv_connector_module_path="kvconn.adapters.vllm"`` keeps
  working.

Read by: engines configured with the old path. No public names of its own; a
change here keeps :mod:`kvconn.adapters.vllm` importing only
:mod:`kvconn.install` (it names the adapter by string: the SDK never imports an
adapter).
"""

from __future__ import annotations

__all__: list[str] = []
