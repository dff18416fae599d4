"""The fit and what runs inside it: Keras `fit` with the runner's callbacks (fit), the checkpoint store and its
one saver (store, tf_store, saver), SIGTERM/SIGINT as a notice (preemption), progress lines and observation
(progress, observe), the model built, compiled and restored (build). No paths of its own and no GCS: the run
folder hands it where to write.
Imports runner.spec, runner.models, runner.device, runner.rundir's timing types and the package root.
"""
