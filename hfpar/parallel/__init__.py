"""hfpar.parallel: tensor-parallel and expert-parallel layers."""
