"""Training for moelab: setup, the step loop, the train step, optimisation, held-out evaluation
and trackers; the run folder it writes is ``moelab.run``."""
