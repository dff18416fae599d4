"""What a job is, top to bottom: run_job (run), the matmul benchmark (matmul), evaluate and predict on a
trained job (predict, its answers in the data's own terms: answers). Imports the core (spec, data, device,
rundir, train, models); never the periphery.
"""
