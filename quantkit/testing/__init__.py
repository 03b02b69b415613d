"""Helpers for tests and benchmarks: the ggml reference through ctypes, tiny model builders."""
