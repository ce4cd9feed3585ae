"""Not run when SGLang serves: SGLang's pools and controller on the CPU (``rig``), injected store faults
(``faults``) and the checks behind ``kvconn validate --engine sglang`` (``checks``). Imports SGLang."""
