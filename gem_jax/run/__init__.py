"""The spine of a run: build(cfg) -> Run (data source, task, model, optimizer, mesh, placement, state, the
one train step and eval step), the tasks, and the optimizers. Everything that trains, evaluates, measures or
simulates a config gets it from here."""
