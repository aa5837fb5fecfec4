"""Training for moelab: setup, the memory preflight, the step loop, the train step,
optimisation, held-out evaluation, trackers, resume rules and plan changes, and what a run
decides from its own routing (``adapt``); the run folder it writes is ``moelab.run``."""
