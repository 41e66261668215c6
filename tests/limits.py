"""How long a test waits for a process, a server, a thread or a file: a hang guard, never a time limit.

A test's outcome must not depend on the machine's load (a suite run on 2 cores with other busy processes beside it
took 111 minutes, and cases with 120-300 s limits failed with ``TimeoutExpired`` though nothing was wrong). So every
wait in the suite is this one guard: far beyond what any case takes on a loaded machine, there only so that a real
hang ends the run instead of holding CI until its own limit. Speed is measured by the benchmarks, never asserted.
"""

HANG_GUARD_S = 1200  # seconds: a stuck process fails its test after 20 minutes (below torch's own 30-minute collective wait)
