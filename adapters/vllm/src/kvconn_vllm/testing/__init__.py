"""kvconn connectors, and vLLM's own, judged through vLLM: nothing here runs when vLLM serves.

The adapter vLLM loads is the package above (:mod:`kvconn_vllm.connector`, :mod:`kvconn_vllm.translate`, the
worker reports and the table tracker). These modules drive it, or one of vLLM's own connectors, through vLLM's
real scheduler and model-runner code on the CPU, for the vLLM test tiers and ``kvconn validate --engine vllm``:

* :mod:`.harness`: vLLM's ``Scheduler`` on the CPU with a tiny model config, and ``VllmLoop``, the worker side
  of each step through vLLM's model-runner code;
* :mod:`.driver` (the ``vllm`` entry point of ``kvconn.conformance_drivers``), :mod:`.data_driver` and
  :mod:`.scheduler_driver`: the conformance drivers for kvconn plugins, and what they share with
* :mod:`.native` and :mod:`.native_data`: the same checks on vLLM's own connectors (``--vllm-connector``),
  with the stand-in of :mod:`.offloading_standin` for a worker that needs CUDA.

Nothing is re-exported here: importing this package imports neither vLLM nor its modules; import the module
that holds what you need.
"""

__all__: list[str] = []
