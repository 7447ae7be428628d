"""Tests of the CUDA path (cuda-marked) and the GPU check's dry run."""
