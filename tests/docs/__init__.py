"""The documentation's tests: every code block runs, the results page renders."""
