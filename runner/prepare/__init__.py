"""Turning datasets into sharded TFRecords with a manifest: built-in datasets (`runner prepare`) and the user's
own records (`runner manifest`)."""
