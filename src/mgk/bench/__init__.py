"""Benchmarks behind BENCHMARKS.md: attention modules and whole models."""
