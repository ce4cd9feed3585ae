"""kvconn connectors, and vLLM's own, judged through vLLM: nothing here runs when vLLM serves.

The adapter vLLM loads is the package above (:mod:`kvconn_vllm.connector` and its sides). These modules drive it,
or one of vLLM's own connectors, through vLLM's real scheduler and model-runner code on the CPU, for the vLLM test
tiers and ``kvconn validate --engine vllm``. Who reads it: kvconn's conformance runner (the ``vllm`` entry point of
``kvconn.conformance_drivers``: :func:`.driver.load_driver`), the CLI (``--vllm-connector``:
:func:`.native.run_native_conformance`), the vLLM tiers' tests and ``benchmarks/`` (:mod:`.harness`).

A driver is composed, not inherited from a grid of mixins: :class:`.scheduler_driver.VllmSchedulerDriver` (vLLM's
scheduler and a :class:`.harness.VllmLoop`) plus an observer of the connector, either the adapter's kvconn hosts
(:class:`.host_observer.HostObserver`) or the connector's class (:class:`.native_observer.NativeObserver`); the data
drivers add a model (:class:`.model_loop.ModelLoop`) and what the data checks read
(:class:`.data_run.VllmDataRunDriver`). Its modules, each importing only those below it (import-linter's
``layers`` contract in pyproject.toml):

* :mod:`.native` | :mod:`.driver`: the entry points, for vLLM's own connectors and for kvconn plugins;
* :mod:`.native_session` | :mod:`.data_driver`: which checks apply to a vLLM connector, and its drivers; the
  plugins' data driver;
* :mod:`.native_driver` | :mod:`.native_data` | :mod:`.host_observer`: a vLLM connector's drivers (scheduler checks,
  data checks, with the monitors of its calls); the observer of a kvconn plugin;
* :mod:`.native_observer` | :mod:`.data_run`: the observer of a vLLM connector and the engine it runs in; what
  the data drivers add to the composed driver;
* :mod:`.scheduler_driver` | :mod:`.model_loop` | :mod:`.stand_ins` | :mod:`.native_target` | :mod:`.wire` |
  :mod:`.plain_view`: the composed driver; the reference model on vLLM's KV caches (a worker per rank); stand-ins
  for workers that cannot run here; which vLLM connector is judged; what pickling its metadata meets; its metadata
  as plain data;
* :mod:`.harness` | :mod:`.offloading_standin`: vLLM's ``Scheduler`` on the CPU and ``VllmLoop`` (a worker per
  tensor-parallel rank); the CPU stand-in of vLLM's offloading spec.

Nothing is re-exported here: importing this package imports neither vLLM nor its modules; import the module
that holds what you need. A change here must update docs/vllm.md and docs/checks.md where they name a module, the
contract in pyproject.toml for a new module, and ``tests/vllm`` (its drivers' tests).
"""

__all__: list[str] = []
