"""Studies over many runs: schedules side by side (``compare``) and across batch sizes
(``crossover``), the policy search (``search``), sweeps across hardware or workload values
(``sweep``), executions against simulations (``validate``), profiles fitted to published
measurements (``fit``, reading ``measurements``), a machine's profile fitted to the executor's
own tasks (``calibrate``, which needs PyTorch), and the jobs they all run, on this machine's
cores or Ray (``jobs``).

They sit above the simulator, the queue and the executor, and below the API and the CLI; they
import downward only."""
