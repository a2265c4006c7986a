"""Helpers the tests share: threads on a barrier joined by one deadline, graph walks, a traced step."""
