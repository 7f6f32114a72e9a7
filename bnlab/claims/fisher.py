"""The Fisher paper, "Mean-field analysis of batch normalization" (ICLR submission, anonymous): its claims and
where bnlab checks them (see :mod:`bnlab.claims.core`).  Equation numbers are the paper's; the errata E1–E6
are those of docs/fisher.md."""
from __future__ import annotations

from bnlab.claims.core import Claim, Paper

__all__ = ["PAPER", "CLAIMS"]

PAPER = Paper("fisher", "Mean-field analysis of batch normalization (the Fisher paper)", "The Fisher paper")

_T = "tests/"
_OP = _T + "fisher/test_order_parameters.py::"
_FC = _T + "fisher/test_fisher_claims.py::"
_CIFAR = "needs CIFAR-10 and VGG16/Preact-ResNet18 training, hours per run on these CPUs"

CLAIMS = [
    Claim("fisher/eq7", "§2.1, Eq. 7", "momentum gradient descent near θ* converges only if η < η* = "
          "2(1+μ)/λmax of the Fisher (= Hessian at θ*)", "formula",
          checks=["fisher-fig2: η* (…) / measured explosion boundary", "fisher-fig2-conv: η*",
                  "fisher-fig3: η* / measured explosion boundary",
                  "advise-validation: lr-below", "advise-validation: lr-above"],
          tests=[_FC + "test_eq7_stability_limit_and_footnote1_optimum_on_a_quadratic"], strength="exact formula",
          note="the quadratic-model statement is tested exactly (the heavy-ball iteration's spectral radius); "
          "the trained networks' explosion boundary is judged by the reproductions"),
    Claim("fisher/eta-star-half", "§2.1 footnote 1, §4, Fig. 2", "the optimal learning rate is η*/2 (the dark "
          "band of the CIFAR-10 heatmaps)", "formula",
          tests=[_FC + "test_eq7_stability_limit_and_footnote1_optimum_on_a_quadratic",
                 _FC + "test_footnote1_half_eta_star_is_optimal_for_the_top_mode_not_for_a_wide_spectrum"],
          checks=["fisher-fig4: fastest γ has η/η* nearest ½"],
          strength="exact formula",
          note="true for the top-curvature mode only: over a spectrum [λmin, λmax] the best step tends to η*, not "
          "η*/2; fisher-fig4 reads the band across γ at a fixed η: the fastest stand-in is mostly the γ whose η "
          "is nearest η*/2 when η* comes from the Hessian of the cross-entropy it trains, rarely when it comes "
          "from the Fisher (docs/fisher.md, 'Fisher Fig. 4: why')"),
    Claim("fisher/eq10", "§2.1, Eqs. 9–10", "for the Gaussian conditional model the Fisher is E_x[∇f ⊗ ∇f] (the "
          "Gauss–Newton matrix of ½‖f − y‖²)", "formula",
          tests=[_T + "fisher/test_spectrum.py::test_train_and_eval_mode_differ_and_mse_ggn_is_the_fisher",
                 _T + "fisher/test_spectrum.py::test_operator_products_match_dense_matrix_vector_products"],
          strength="exact formula"),
    Claim("fisher/base-case", "§3.1.1 and Claim 6.1", "the base cases q̂⁰ = 0, q̂⁰_xy = 1 (§3.1.1) and q̂⁰ = 1, "
          "q̂⁰_xy = 0 (Claim 6.1) for mean-0, variance-1 data", "formula",
          tests=[_OP + "test_base_case_of_section_3_is_inconsistent"], strength="exact formula",
          note="erratum E1: only Claim 6.1's values are possible for such data"),
    Claim("fisher/eq20-22", "§3.1.1, Eqs. 20–22 (Karakida et al.)", "order-parameter recursions of vanilla ReLU FC "
          "layers (forward q, q_xy; backward q̃, q̃_xy)", "formula",
          tests=[_OP + "test_vanilla_fc_paper_and_measured_coincide",
                 _OP + "test_measured_formula_matches_finite_network_and_paper_bn_formula_does_not",
                 _OP + "test_generic_phi_quadrature_route_agrees_with_closed_forms"],
          strength="simulation"),
    Claim("fisher/eq23-24", "§3.1.1, Eqs. 23–24, Claim 6.1", "BN forward recursions: q̂ = γ²/2, q̂_xy = γ²/(2π) "
          "(population statistics)", "formula",
          tests=[_OP + "test_paper_formula_reproduces_printed_relu_closed_forms",
                 _OP + "test_measured_formula_matches_finite_network_and_paper_bn_formula_does_not"],
          strength="simulation"),
    Claim("fisher/eq25", "§3.1.1, Eq. 25, Claim 6.2", "BN backward recursions q̃^l = γ²σ_w²q̃^{l+1}/(2q^l), "
          "q̃^l_xy = γ²σ_w²q̃^{l+1}_xy/(4q^l)", "formula",
          tests=[_OP + "test_measured_formula_matches_finite_network_and_paper_bn_formula_does_not",
                 _OP + "test_bn_relu_bound_is_quadratic_in_gamma"],
          strength="simulation",
          note="erratum E2: the derivation (Eq. 66) divides by the data variance s² = q − q_xy, not q; the "
          "printed form is 1.6× off at γ = 1 — the finite network follows the corrected one"),
    Claim("fisher/eq34-38", "§3.2.1, Eqs. 34–38, Claims 6.5–6.6", "order-parameter recursions of vanilla conv "
          "layers, including the cross-position q_αβ", "formula",
          tests=[_OP + "test_conv_whose_kernel_covers_its_input_reduces_to_fc",
                 _OP + "test_measured_formula_matches_finite_network_and_paper_bn_formula_does_not"],
          strength="simulation"),
    Claim("fisher/eq39-43", "§3.2.1, Eqs. 39–43, Claims 6.3–6.4", "BN conv recursions (forward as FC; backward "
          "with q̃_αβ,xy = γ²σ_w² q̃^{l+1}_αβ,xy/(4q^l))", "formula",
          tests=[_OP + "test_measured_formula_matches_finite_network_and_paper_bn_formula_does_not"],
          strength="simulation",
          note="errata E3 (stride and padding) and E4 (the cross-position base case): the printed conv bound is "
          "10²–10⁵ times too large; the finite network follows the corrected recursions"),
    Claim("fisher/claim31-fc", "§3.3, Claim 3.1 (Eq. 44), App. 6.3 (Eqs. 154–161)", "for wide FC networks "
          "λ̄max ≥ Σ_l N_{l−1} q̂^{l−1}_xy q̃^l_xy, with and without BN", "formula",
          tests=[_T + "fisher/test_bound.py::test_measured_lambda_max_is_at_least_the_bound"],
          checks=["fisher-lambda-measured: …: measured λmax / bound (corrected)"], strength="simulation",
          note="a lower bound only for BN in eval mode (population statistics): in train mode the paper's bound "
          "fails (tests/fisher/test_bound.py::test_the_papers_population_bound_fails_for_bn_in_train_mode)"),
    Claim("fisher/claim31-conv", "§3.3, Claim 3.1 (Eq. 45), App. 6.3 (Eqs. 162–168)", "for wide conv networks "
          "λ̄max ≥ Σ_l N_{l−1}[(|K|−1)q̃_αβ + q̃_xy][(|K|−1)q̂_αβ + q̂_xy]", "formula",
          tests=[_T + "fisher/test_bound.py::test_measured_lambda_max_is_at_least_the_bound"],
          checks=["fisher-lambda-measured: …: measured λmax / bound (corrected)"], strength="simulation",
          note="erratum E5: Eq. 166 replaces an average of products by a product of averages"),
    Claim("fisher/bn-train-mode", "§3.1 (population statistics, Eqs. 14–15)", "the bound for BN computed with the "
          "data's mean and variance — the model of a network normalizing with population statistics", "formula",
          tests=[_T + "fisher/test_bound.py::test_the_papers_population_bound_fails_for_bn_in_train_mode",
                 _OP + "test_train_mode_keeps_only_layers_without_bn"],
          checks=["fisher-lambda-measured: …, BN train mode: measured λmax / the paper's"],
          strength="simulation",
          note="bnlab finds that with batch statistics (train mode) only the output layer's term survives"),
    Claim("fisher/eq147", "App. 6.3, Eq. 147", "upper bound λmax(I_θ) ≤ E_x⟨∇f(x), ∇f(x)⟩ (convexity of λmax)",
          "formula", tests=[_FC + "test_eq147_lambda_max_between_the_mean_gradient_and_the_mean_squared_gradient"],
          strength="exact formula"),
    Claim("fisher/small-terms", "App. 6.3, Eqs. 156–158", "the b, γ, β terms of f_l are N_l times smaller than the "
          "weight term and can be dropped", "formula",
          not_checked="bnlab's bound drops these terms as the paper does; no test measures them against the "
          "weight term"),
    Claim("fisher/finite-m", "App. 6.1 after Eq. 62", "with m data points the x = y pairs bias the x ≠ y order "
          "parameters by O(1/m)", "formula",
          not_checked="the order-parameter tests allow for this bias in their tolerances "
          "(tests/fisher/test_order_parameters.py) but no test measures it as a function of m"),
    Claim("fisher/conv-example", "App. 6.2 (CIFAR-10 example)", "a 3×3 stride-2 conv without padding on 32×32×3 "
          "inputs with 20 channels has C₀ = 3, |K₀| = 1024, |F₁| = 9, |K₁| = 225", "formula",
          tests=[_T + "fisher/test_architecture.py::test_geometry_matches_torch_shapes"], strength="exact formula",
          note="the geometry is tested on another spec; the example's own numbers are not asserted"),
    Claim("fisher/quadratic-gamma", "§4 and §6.5", "λ̄max of a ReLU-BN network grows as γ² (so smaller γ, larger η*)",
          "formula", tests=[_OP + "test_bn_relu_bound_is_quadratic_in_gamma"], strength="exact formula",
          note="exactly ∝ γ² with the corrected recursions; the printed ones depend on σ_b² too"),
    Claim("fisher/fig1-bound", "§4, Fig. 1 (a, c)", "for γ ≲ 3 BN lowers the bound on λ̄max below the vanilla "
          "network's, FC and conv (the flattening effect)", "figure",
          checks=["fisher-fig1: …: γ below which BN lowers λ̄max (paper formula)",
                  "fisher-fig1: …: γ below which BN lowers λ̄max (measured formula)"],
          strength="exact formula",
          note="with the corrected recursions the crossing is at γ ≈ 2.5 (FC and conv); ≈ 2.8–2.9 as printed"),
    Claim("fisher/fig1-eta", "§4, Fig. 1 (b, d)", "for small γ, η* of the BN network exceeds the vanilla one's by "
          "orders of magnitude", "figure",
          checks=["fisher-fig1: …: η* of the BN network at the smallest γ / vanilla"], strength="exact formula"),
    Claim("fisher/fig2-boundary", "§4, Fig. 2", "the (γ, log₁₀η) plane splits into convergent and exploding phases and "
          "the predicted η* closely agrees with the measured boundary (FC and conv, MNIST and CIFAR-10)", "figure",
          checks=["fisher-fig2: η* (…) / measured explosion boundary", "fisher-fig2-conv: η*"],
          strength="small-scale stand-in",
          note="the FC and conv panels on MNIST (100 steps, one seed for the conv net); the CIFAR-10 panels are not "
          "run (CIFAR-10 is not available offline)"),
    Claim("fisher/fig2-small-gamma", "§4, Fig. 2, §5", "smaller γ initialization gives lower test loss after a fixed "
          "number of epochs", "figure",
          checks=["fisher-fig4: mean training loss over the run against γ",
                  "fisher-fig4: steps until the training loss"], strength="small-scale stand-in",
          note="judged on the training loss of fisher-fig4's stand-ins, not on Fig. 2's test loss"),
    Claim("fisher/fig3", "App. 6.4, Fig. 3", "for vanilla FC networks the maximal learning rate falls as the weight "
          "variance σ_w grows, as η* predicts", "figure",
          checks=["fisher-fig3: explosion boundary against σ_w", "fisher-fig3: η* / measured explosion boundary"],
          strength="small-scale stand-in"),
    Claim("fisher/fig4", "App. 6.5, Fig. 4", "VGG16 and Preact-ResNet18 on CIFAR-10 (η = 0.1, momentum 0.9) "
          "converge faster with a smaller γ initialization", "figure",
          checks=["fisher-fig4: mean training loss over the run against γ",
                  "fisher-fig4: steps until the training loss"], strength="small-scale stand-in",
          note="stand-ins: a BN MLP and CNN on MNIST (" + _CIFAR + "). Contradicted as a law for every γ, and "
          "explained by the paper's own argument (fisher/fig4-mechanism; issue #23 item 6, docs/fisher.md "
          "'Fisher Fig. 4: why'): at η = 0.1 the stand-ins' η/η*(γ) runs from far below ½ (γ = 0.1) to beyond "
          "1 (γ = 2), where the argument predicts a fastest γ near η ≈ η*/2 with the smaller γ under-stepping, "
          "not a monotone law"),
    Claim("fisher/fig4-mechanism", "§4 (end), App. 6.5", "smaller γ converges faster because it greatly reduces "
          "the Fisher's λmax (∝ γ²), so a fixed η lies further below η* = 2(1+μ)/λmax", "headline",
          checks=["fisher-fig4: η/η* per γ", "fisher-fig4: fastest γ has η/η* nearest ½",
                  "fisher-fig4: mean training loss rises with γ where η ≥ η*/2"], strength="small-scale stand-in",
          note="judged by the argument's predictions at a fixed η, with η* measured at initialization: among the "
          "γ with η ≥ η*/2 of the loss trained (the cross-entropy Hessian) the smaller γ is mostly faster and "
          "the fastest γ is mostly the one with η nearest η*/2; below η*/2 a smaller γ is slower (its "
          "effective step ηγ² is smaller), and at a rate below every γ's η*/2 (medium scale) the order "
          "reverses. With the Fisher's η* (the squared loss', lower than the cross-entropy one) the fastest γ "
          "is placed wrongly; BN nets beyond η* slow down instead of diverging (docs/fisher.md 'Fisher Fig. 4: "
          "why')"),
    Claim("fisher/abstract-flattening", "Abstract, §1, §5", "BatchNorm flattens the loss landscape, as quantified "
          "by the Fisher's largest eigenvalue, and so permits larger learning rates", "headline",
          checks=["fisher-fig1: …: γ below which BN lowers λ̄max (paper formula)",
                  "fisher-lambda-measured: …: measured λmax / bound (corrected)"], strength="simulation"),
    Claim("fisher/conclusion-agreement", "§5", "the theoretical η* agrees closely with the experimentally "
          "determined phase boundaries", "headline",
          checks=["fisher-fig2: η* (…) / measured explosion boundary", "fisher-fig2-conv: η*"],
          strength="small-scale stand-in"),
]
