"""Config text shared by the tests of `spherepde run`."""

# the paper's matrices at β = 10 and a vMF start; tests append [eulerian] and [time]
PAPER_VMF_CONFIG = """
[model]
beta = 10.0
V = [[-1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, -2.0]]
B = [[-1.0, 0.0, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 1.0]]

[initial]
kind = "vmf"
mu = [0.6, 0.0, 0.8]
kappa = 3.0
"""
