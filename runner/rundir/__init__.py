"""The run folder: every write a job makes and the resume rules (outputs), the lease that makes one run its
owner (lease), one attempt and its summary (attempt, timing), the exported model (serving), the weights a run
reports to evaluate and predict (reported). Imports runner.spec, runner.data.storage, runner.device and the
package root.
"""
