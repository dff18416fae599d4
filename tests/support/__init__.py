"""Test support that runs real servers: the GCS rig (gcs.py) and the processes behind it (gcs_servers.py)."""
