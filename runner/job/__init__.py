"""What a job is, top to bottom: run_job (run), the matmul benchmark (matmul), evaluate and predict on a
trained job (predict). Imports the core (spec, data, device, rundir, train, models); never the periphery.
"""
