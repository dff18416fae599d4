"""The device a job runs on: TensorFlow-free host facts (host), the one strategy resolver (strategy), the TPU
device API set before TensorFlow loads (tpu_env), precision, the Keras flavour and bounded calls. Imports
runner.spec, runner.models' table and the package root.
"""
