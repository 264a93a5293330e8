"""What a run means: the theory's diagnostics of any weighted measure on S² (alignment, W₂ to
Π#ρ₀, the Lyapunov functional, the bounds) and the exact solutions the tests are built on."""
