"""Running a job on Google Cloud: a Cloud TPU VM through a queued resource (submit.py, tpu_startup.sh), its
logs and cost (logs.py, pricing.py), the user's code sent with it (codepack.py, codefetch.py)."""
