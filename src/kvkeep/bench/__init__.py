"""The measuring instrument: workload, runner, launcher, scenarios and reports."""
