"""Library or template, per region (gjit.config.matmul "auto", the default): each matmul and
attention region runs its template kernel (with the prologue and epilogue it fused) or ATen's
kernels (cuBLAS; SDPA's flash or memory-efficient kernel) plus generated kernels for what the
template would have fused, whichever is faster for that region at the call's sizes.

Which templates are built to be measured at all depends on the mode. Under mode="max-autotune"
(and GJIT_MEASURE_ALL_TEMPLATES=1), every product's. In the other modes, only a written-out
attention's (`table.worth_measuring`: the library side writes and reads the score matrix there),
with the regions the table below has; every other product runs the library's kernel without a
template being built. On the H200 (docs/bench.md), over the six workloads of bench/models_gpu.py,
the library won 65 of the 66 choices measured (a choice covers a model's layers alike), and the
stage that built and timed the templates was 37-59% of each cold compile.

Measured (a GPU, tuning on: `measure.measured`), within a budget (`tuning.Budget`: by default a
fifth of the cold compile; none under mode="max-autotune"):

1. The program with every product a template that is to be measured (the driver's first
   compile), run once (the call's own first run: not the budget's). Each distinct template
   kernel (the layers of a model share one: decided once), heaviest by modeled time first, is
   timed in the configuration the table gave it, or takes the record an earlier compile kept
   (gjit/runtime/tuning_store.py: by kernel code, size bucket, GPU and versions, on disk and in
   the remote cache).
2. The program with every product an ATen extern (`library.LibrarySide`), run once, its extern
   calls of products and its kernels kept, whenever a timed template needs the library's time
   (its record has none, it is not too short to matter), past the budget too: a timed template
   without it decides nothing. A record's configuration is run once on this call first.
   A region's library side is the extern calls of its products plus, of each kernel there that
   computes nodes the template fused (a bias, an activation, a residual, a post-norm, the
   statistics of the norm its prologue applies; every product of a q/k/v group), the share those
   nodes are of the kernel's nodes (a node fused by several templates split between them). Only
   those pieces are timed, each once.
3. With what the budget leaves, each kernel's other tile configurations (gjit/tuning.py), heaviest
   first, from where its record stopped.
4. The template where it is faster, else the library. A template under MIN_KERNEL_MS keeps its
   one launch without the library being tried (launch-bound either way), but a float32 product
   without TF32 (the template on the FMA units: 6x cuBLAS on an H200) is always compared. What
   the budget left unmeasured takes the table's choice (`measure.table_choice`). Each kernel's
   measurements are kept for later compiles (`measure.keep`).
5. The program compiled with that choice. A template region next to one that went to the
   library may fuse otherwise there (an activation left in a kernel of its own joins the next
   template's prologue): such a region is measured again as it now fuses, at most MAX_ROUNDS
   times; a choice that does not settle runs every product in ATen.

The whole-program comparison of earlier versions is gone: per region is finer, costs two program
timings less, and on the H200 a tie of whole programs (0.266 against 0.257 ms) overrode the Llama
down projection's kernel, 7% faster than cuBLAS's GEMM plus the add.

Not measured (tuning off, not on a GPU, `gjit.aot` for a card that is not there:
`table.unmeasured`): the library, and the template only where kernels/template_wins.py's table,
measured on such a card, has this very region. The choice (`TemplateChoice`, each region's
figures with it) is part of the compiled entry: a warm start lowers by it and measures nothing.

Then, on the program chosen, each row kernel a little longer than a tile runs looped or persistent,
whichever is measured faster (`row_kernels`; not measured: looped, the table's).

Modules: `regions` (what a template region is, for the choice), `library` (the library's side),
`measure` (the measured choice), `row_kernels` (looped or persistent, measured), `table` (the
choice where nothing is measured).
"""
