"""The device a job runs on: TensorFlow-free host facts (host), the Cloud TPU facts table (tpus), the one
strategy resolver (strategy), peaks, precision and bounded calls. Imports runner.spec, runner.models' table and
the package root.
"""
