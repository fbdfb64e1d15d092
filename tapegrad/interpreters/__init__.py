"""Interpreters: functions over tape data, one per target. They never import Tensor."""
