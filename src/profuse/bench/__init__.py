"""Timing, statistics and byte models: the harness behind every number profuse reports."""

# One default number of timed trials for every command and library function (Part B, sweeps,
# Part C, bench.timing.compare): the count from which the bootstrap's interval is trusted
# (bench.stats.BCA_LEAST_TRIALS says why 30). Here, where nothing is imported, so the CLI's
# --help can name it without loading torch.
DEFAULT_TRIALS = 30
