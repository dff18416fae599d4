"""The data a job reads: TFRecord shards and their manifest (verify, integrity), the record schema (schema), the
tf.data pipeline (pipeline), which split trains, validates, selects and measures (splits), a training split held
in memory (in_memory) and gs:// settings and faults (storage). Imports runner.spec and the package root.
"""
