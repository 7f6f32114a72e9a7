"""The floor of :mod:`bnlab.theory`: quadrature rules, grids and weights (private to the theory).

Nothing in this package imports anything else from :mod:`bnlab.theory`; every route of the theory
integrates its φ on these rules.  :mod:`.rules`: one-dimensional rules (tanh-sinh, Gauss–Legendre,
Gauss–Jacobi, the sin^k θ weight, the radial rules of ε > 0); :mod:`.kinks`: where φ is not smooth, i.e.
where the rules are cut; :mod:`.sphere`: rules on the batchnorm sphere (the (s, θ) rule, the kink-split
Cartesian rule, the pair rules of ε > 0) and Monte Carlo samples of it.
"""
