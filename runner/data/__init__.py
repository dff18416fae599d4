"""The data a job reads: TFRecord shards and their manifest (verify, integrity), the record schema (schema), the
tf.data pipeline (pipeline), which split trains, validates, selects and measures (splits), a training split held
in memory (in_memory), gs:// settings and faults (storage), and the user's own files read as `runner prepare`
reads them (rows). Imports runner.spec and the package root.
"""
