"""Tensor parallelism and DTensor on the bytescale backend, on torch's own (shipped) test harness.

CI cannot run torch's tensor-parallel / DTensor test files (they are not in the torch wheel; see
``test_torch_tensor_suite.py``), so these tests use what IS shipped: ``DTensorTestBase`` (4 spawned
ranks, ``@with_comms``), pointed at bytescale by ``torch_tensor_suite.BytescaleDTensorTestBase``,
and its reference ``Transformer`` / ``ModelArgs`` with torch's own TP plan
(``Transformer.parallelize``). Every check compares against an unsharded reference computed on
each rank from the same seed: float64 model, forward, backward and optimizer steps.

- 1-D mesh: torch's colwise/rowwise plan with and without sequence parallelism, and a sequence-
  parallel plan with a vocabulary-sharded output and ``loss_parallel`` cross-entropy;
- 2-D mesh (dp 2 x tp 2): TP on the "tp" dimension, each dp rank on half the global batch,
  gradients averaged over the "dp" groups by hand, and with FSDP2 over "dp" (TorchTitan's 2-D);
- redistribute Shard <-> Replicate <-> Partial on 1-D and 2-D meshes with uneven shapes
  (all-gather, reduce-scatter, all-reduce, with the collective counts torch expects), DTensor's
  all-to-all op (``_dtensor::shard_dim_alltoall``, which DTensor uses for Shard(i) -> Shard(j) on
  GPUs; on CPU meshes DTensor falls back to all-gather), and DTensor ops that communicate;
- a torch 2.14.1 DTensor case whose ranks issue collectives of different sizes: a clear error on
  every rank (Gloo aborts the process), the groups usable afterwards.
"""
from __future__ import annotations

import itertools
from copy import deepcopy

import pytest

pytest.importorskip("expecttest", reason="torch's test utilities need expecttest (pip install expecttest)")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed._functional_collectives as funcol  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor.debug import CommDebugMode  # noqa: E402
from torch.distributed.tensor.experimental import implicit_replication  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.testing._internal.common_utils import run_tests  # noqa: E402
from torch.testing._internal.distributed._tensor.common_dtensor import (  # noqa: E402
    ModelArgs,
    Transformer,
    with_comms,
)

import bytescale  # noqa: E402,F401  (registers the backend in every rank)
from torch_tensor_suite import BytescaleDTensorTestBase  # noqa: E402

pytestmark = pytest.mark.multiprocess  # spawned ranks (not run_distributed, so say it here)
c10d = torch.ops.c10d_functional
BATCH, SEQ = 4, 8  # SEQ divisible by the TP degree (sequence parallelism shards it)


def _args() -> ModelArgs:
    # dropout off: the sharded and the unsharded model must compute the same function
    return ModelArgs(n_layers=2, vocab_size=8, max_seq_len=SEQ, dim=16, n_heads=4, dropout_p=0.0)


def _sp_loss_parallel_plan(model: Transformer, tp_mesh) -> Transformer:
    """Sequence parallelism with the output projection sharded over the vocabulary (its logits
    stay Shard(-1) for ``loss_parallel``), attention on the rank's local heads: the layout of
    torch's ``Transformer.parallelize(use_seq_parallel=True)`` except for the output."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "pos_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, {
            "attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            "attention_norm": SequenceParallel(),
            "ffn_norm": SequenceParallel(),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w1": ColwiseParallel(input_layouts=Shard(1)),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })
        layer.attention.n_heads = model.model_args.n_heads // tp_mesh.size()
    if model.model_args.weight_tying:
        model.output.weight = model.tok_embeddings.weight
    return model


class TestDTensorTensorParallelOnBytescale(BytescaleDTensorTestBase):
    """world size 4 (the harness default), every group on bytescale.

    Ranks are not forked from the pytest process: in the full suite it has run other tests and
    holds their threads, and a fork copies locks those threads held (the ranks then stall). They
    are started as torch's harness spawns them, but from the test harness' forkserver
    (tests/dist_utils.py: a clean process with torch imported, started with the session), which
    saves each rank its interpreter start and torch import. The class body carries the bytescale
    overrides, so a rank that imports this module gets them."""

    def _spawn_processes(self) -> None:
        from dist_utils import start_context

        self._start_processes(start_context().Process)

    def _assert_on_bytescale(self, mesh) -> None:
        for dim in range(mesh.ndim):
            self.assertEqual(dist.get_backend(mesh.get_group(dim)), "bytescale")

    def _assert_grads_equal(self, ref: torch.nn.Module, tp: torch.nn.Module) -> None:
        ref_params = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            self.assertEqual(grad, ref_params[name].grad, msg=f"gradient of {name}")

    def _assert_params_equal(self, ref: torch.nn.Module, tp: torch.nn.Module) -> None:
        ref_params = dict(ref.named_parameters())
        for name, p in tp.named_parameters():
            value = p.full_tensor() if isinstance(p, DTensor) else p
            self.assertEqual(value, ref_params[name], msg=f"parameter {name}")

    def _train_and_compare(self, model, model_tp, batches, loss_fn, loss_fn_tp, grad_sync=None):
        """Steps of SGD with momentum on both models; outputs' losses, every gradient and every
        parameter after each step equal the unsharded model's. (SGD, not Adam: the model's logits
        are float32 (``Transformer.forward`` casts them), and Adam's normalisation turns float32
        rounding in a near-zero gradient into a full-size step.)"""
        opt = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.9, foreach=False)
        opt_tp = torch.optim.SGD(model_tp.parameters(), lr=0.25, momentum=0.9, foreach=False)
        for tokens, targets, tokens_tp, targets_tp in batches:
            loss = loss_fn(model(tokens), targets)
            loss.backward()
            loss_tp = loss_fn_tp(model_tp, tokens_tp, targets_tp)
            if grad_sync is not None:
                grad_sync(model_tp)
            else:
                self.assertEqual(loss_tp, loss.detach())
            self._assert_grads_equal(model, model_tp)
            opt.step()
            with implicit_replication():
                opt_tp.step()
            opt.zero_grad()
            opt_tp.zero_grad()
            self._assert_params_equal(model, model_tp)

    def _batches(self, n: int, batch: int = BATCH):
        torch.manual_seed(1234)  # the same tokens on every rank
        vocab = _args().vocab_size
        return [(torch.randint(vocab, (batch, SEQ)), torch.randint(vocab, (batch, SEQ))) for _ in range(n)]

    @with_comms
    def test_transformer_tp_1d_matches_unsharded(self):
        """torch's Transformer TP plan (colwise/rowwise attention and MLP, vocab-parallel
        embedding, replicated output), with and without sequence parallelism, float64."""
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        self._assert_on_bytescale(mesh)

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        for seq_parallel in (False, True):
            torch.manual_seed(0)
            model = Transformer(_args()).to(torch.float64)
            model_tp = Transformer.parallelize(deepcopy(model), mesh, seq_parallel, local_output_for_attn=True)
            batches = [(t, y, t, y) for t, y in self._batches(3)]

            def loss_fn_tp(m, tokens, targets):
                loss = loss_fn(m(tokens), targets)
                loss.backward()
                return loss.detach()

            comm = CommDebugMode()
            with comm:
                self._train_and_compare(model, model_tp, batches, loss_fn, loss_fn_tp)
            counts = comm.get_comm_counts()
            if seq_parallel:  # sequence parallelism: all-gather in, reduce-scatter out
                self.assertGreater(counts[c10d.all_gather_into_tensor], 0)
                self.assertGreater(counts[c10d.reduce_scatter_tensor], 0)
            else:  # row-wise outputs: all-reduce
                self.assertGreater(counts[c10d.all_reduce], 0)

    @with_comms
    def test_transformer_sequence_and_loss_parallel(self):
        """Sequence parallelism with vocabulary-sharded logits and loss_parallel cross-entropy
        (the logits are never gathered), tied embedding/output weights, float64."""
        mesh = init_device_mesh(self.device_type, (self.world_size,))
        torch.manual_seed(0)
        model = Transformer(_args()).to(torch.float64)
        model_tp = _sp_loss_parallel_plan(deepcopy(model), mesh)
        batches = [(t, y, t, y) for t, y in self._batches(3)]

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        def loss_fn_tp(m, tokens, targets):
            logits = m(tokens)
            self.assertIsInstance(logits, DTensor)
            self.assertEqual(logits.placements, (Shard(2),))
            with loss_parallel():
                loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
                loss.backward()
            self.assertTrue(loss.placements[0].is_replicate())
            return loss.full_tensor().detach()

        self._train_and_compare(model, model_tp, batches, loss_fn, loss_fn_tp)

    @with_comms
    def test_transformer_2d_mesh_dp_tp(self):
        """dp 2 x tp 2: torch's sequence-parallel TP plan on the "tp" dimension, each dp rank on
        half of the global batch, gradients averaged over the "dp" groups: the unsharded model
        on the whole batch."""
        mesh = init_device_mesh(self.device_type, (2, self.world_size // 2), mesh_dim_names=("dp", "tp"))
        self._assert_on_bytescale(mesh)
        dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
        torch.manual_seed(0)
        model = Transformer(_args()).to(torch.float64)
        model_tp = Transformer.parallelize(deepcopy(model), mesh["tp"], True, local_output_for_attn=True)
        half = BATCH // dp_size
        batches = [(t, y, t[dp_rank * half:(dp_rank + 1) * half], y[dp_rank * half:(dp_rank + 1) * half])
                   for t, y in self._batches(3)]

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        def loss_fn_tp(m, tokens, targets):
            loss = loss_fn(m(tokens), targets)
            loss.backward()
            return loss.detach()

        dp_group = mesh.get_group("dp")

        def average_over_dp(m):
            seen = set()
            for p in m.parameters():
                if id(p) in seen:  # tied weights: one gradient
                    continue
                seen.add(id(p))
                local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(local, group=dp_group)
                local.div_(dp_size)

        self._train_and_compare(model, model_tp, batches, loss_fn, loss_fn_tp, grad_sync=average_over_dp)

    @with_comms
    def test_transformer_2d_mesh_fsdp2_tp(self):
        """dp 2 x tp 2 as TorchTitan composes them: torch's TP plan on "tp", then FSDP2
        (``fully_shard``) over "dp", which shards the TP-sharded parameters again and
        reduce-scatters their gradients over the dp groups: the unsharded model on the whole batch."""
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(self.device_type, (2, self.world_size // 2), mesh_dim_names=("dp", "tp"))
        dp_rank, dp_size = mesh.get_local_rank("dp"), mesh.size(0)
        torch.manual_seed(0)
        model = Transformer(_args()).to(torch.float64)
        model_tp = Transformer.parallelize(deepcopy(model), mesh["tp"], False, local_output_for_attn=True)
        fully_shard(model_tp, mesh=mesh["dp"])
        names = {p.device_mesh.mesh_dim_names for p in model_tp.parameters()}
        self.assertEqual(names, {("dp",), ("dp", "tp")})  # norms: FSDP only; the rest: FSDP x TP
        half = BATCH // dp_size
        batches = [(t, y, t[dp_rank * half:(dp_rank + 1) * half], y[dp_rank * half:(dp_rank + 1) * half])
                   for t, y in self._batches(3)]

        def loss_fn(logits, targets):
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

        def loss_fn_tp(m, tokens, targets):
            loss = loss_fn(m(tokens), targets)
            loss.backward()
            return loss.detach()

        # FSDP2 averages the gradients over dp itself; the per-rank loss is its half-batch's.
        self._train_and_compare(model, model_tp, batches, loss_fn, loss_fn_tp, grad_sync=lambda m: None)

    @with_comms
    def test_redistribute_shard_replicate_partial(self):
        """Every Shard/Replicate/Partial -> Shard/Replicate redistribution on a 1-D and a 2-D mesh,
        uneven shapes, equal to the global tensor, with the collectives DTensor plans for it."""
        ws = self.world_size
        meshes = [init_device_mesh(self.device_type, (ws,)),
                  init_device_mesh(self.device_type, (2, ws // 2))]
        torch.manual_seed(7)
        shapes = [(7, 5), (ws * 3, ws * 2 + 1), (1, 3)]  # uneven, and fewer rows than ranks
        for mesh, shape in itertools.product(meshes, shapes):
            self._assert_on_bytescale(mesh)
            full = torch.randn(shape, dtype=torch.float64)
            sources = [Shard(0), Shard(1), Replicate(), Partial()]
            targets = [Shard(0), Shard(1), Replicate()]
            even = all(n % ws == 0 for n in shape)
            for src in itertools.product(sources, repeat=mesh.ndim):
                if mesh.ndim == 2 and not even and any(p.is_partial() for p in src):
                    # torch 2.14.1's DTensor sizes the reduce-scatter of a Partial into a nested
                    # uneven Shard on a 2-D mesh differently on different ranks (e.g. (S(0), P) ->
                    # (S(0), S(0)) of 7 rows): Gloo aborts the process ("Received data size doesn't
                    # match expected size"), bytescale raises "collective mismatch across ranks".
                    continue
                for dst in itertools.product(targets, repeat=mesh.ndim):
                    if any(p.is_partial() for p in src):
                        # a Partial DTensor whose sum is `full`: each rank holds full / (group size)
                        n_partial = 1
                        for d, p in enumerate(src):
                            if p.is_partial():
                                n_partial *= mesh.size(d)
                        repl = [Replicate() if p.is_partial() else p for p in src]
                        dt = distribute_tensor(full, mesh, repl)
                        dt = DTensor.from_local(dt.to_local() / n_partial, mesh, src, run_check=False)
                    else:
                        dt = distribute_tensor(full, mesh, src)
                    comm = CommDebugMode()
                    with comm:
                        out = dt.redistribute(mesh, dst)
                    self.assertEqual(out.placements, dst)
                    self.assertEqual(out.full_tensor(), full, msg=f"{src} -> {dst} on {mesh.shape}, {shape}")
                    self.assertEqual(out.to_local(), distribute_tensor(full, mesh, dst).to_local())
                    counts = comm.get_comm_counts()
                    if mesh.ndim == 1:
                        s, d = src[0], dst[0]
                        if s.is_partial():
                            want = c10d.all_reduce if d.is_replicate() else c10d.reduce_scatter_tensor
                            self.assertEqual(counts[want], 1, msg=f"{s} -> {d}")
                        elif s.is_shard() and d.is_replicate():
                            self.assertEqual(counts[c10d.all_gather_into_tensor], 1)
                        elif s == d or s.is_replicate():
                            self.assertEqual(comm.get_total_counts(), 0)

        # backward of a redistribution: Shard -> Replicate forward (all-gather) gives a Shard
        # gradient; Replicate -> Shard backward all-gathers it.
        mesh = meshes[0]
        x = torch.randn(ws * 2 + 1, 3, dtype=torch.float64, requires_grad=True)
        dt = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        (dt.redistribute(mesh, [Replicate()]).to_local() * 3).sum().backward()
        self.assertEqual(dt.grad.placements, (Shard(0),))
        self.assertEqual(dt.grad.full_tensor(), torch.full_like(x, 3.0))

    @with_comms
    def test_uneven_nested_reduce_scatter_is_a_clear_error_not_an_abort(self):
        """The torch 2.14.1 DTensor case left out above, (Shard(0), Partial()) -> (Shard(0),
        Shard(0)) of 7 rows on a 2 x 2 mesh, whose ranks issue collectives of different sizes:
        on bytescale every rank raises the consistency check's error naming both sizes (Gloo
        aborts the process), and the groups stay usable. A torch that sizes it consistently must
        give the right tensor instead."""
        mesh = init_device_mesh(self.device_type, (2, self.world_size // 2))
        full = torch.arange(7 * 5, dtype=torch.float64).reshape(7, 5)
        dt = distribute_tensor(full, mesh, [Shard(0), Replicate()])
        dt = DTensor.from_local(dt.to_local() / mesh.size(1), mesh, [Shard(0), Partial()], run_check=False)
        try:
            out = dt.redistribute(mesh, [Shard(0), Shard(0)]).full_tensor()
        except RuntimeError as e:
            self.assertRegex(str(e), r"collective mismatch across ranks.*\d+ elements.*\d+ elements")
        else:
            self.assertEqual(out, full)
        # the groups still work after the error
        x = torch.ones(3, dtype=torch.float64)
        dist.all_reduce(x, group=mesh.get_group(1))
        dist.all_reduce(x, group=mesh.get_group(0))
        self.assertEqual(x, torch.full((3,), 4.0, dtype=torch.float64))

    @with_comms
    def test_shard_dim_alltoall_and_communicating_ops(self):
        """DTensor's all-to-all op on bytescale groups (a 1-D mesh and both dimensions of a 2-D
        mesh, forward and backward) against the all-gather fallback DTensor uses on CPU meshes;
        DTensor ops whose sharding needs all-gather / reduce-scatter / all-reduce."""
        ws = self.world_size
        mesh2 = init_device_mesh(self.device_type, (2, ws // 2))
        mesh1 = init_device_mesh(self.device_type, (ws,))
        torch.manual_seed(3)
        for mesh, mesh_dim in [(mesh1, 0), (mesh2, 0), (mesh2, 1)]:
            n = mesh.size(mesh_dim)
            full = torch.randn(n * 3, n * 2, 5, dtype=torch.float64)
            for gather_dim, shard_dim in [(0, 1), (1, 0), (0, 2)]:
                if full.shape[shard_dim] % n:
                    continue
                placements = [Replicate()] * mesh.ndim
                placements[mesh_dim] = Shard(gather_dim)
                local = distribute_tensor(full, mesh, placements).to_local().requires_grad_()
                group = mesh.get_group(mesh_dim)
                out = torch.ops._dtensor.shard_dim_alltoall(
                    local, gather_dim, shard_dim, funcol._group_or_group_name(group))
                want = full.tensor_split(n, dim=shard_dim)[mesh.get_local_rank(mesh_dim)]
                self.assertEqual(out, want)
                (out * 2).sum().backward()  # the backward is the inverse all-to-all
                self.assertEqual(local.grad, torch.full_like(local, 2.0))

        mesh = mesh1
        a = torch.randn(ws * 2, 6, dtype=torch.float64)
        b = torch.randn(6, ws + 3, dtype=torch.float64)
        da, db = distribute_tensor(a, mesh, [Shard(1)]), distribute_tensor(b, mesh, [Shard(0)])
        comm = CommDebugMode()
        with comm:
            prod = da @ db  # Partial, then reduce-scatter to Shard(0)
            self.assertTrue(prod.placements[0].is_partial())
            rs = prod.redistribute(mesh, [Shard(0)])
        self.assertEqual(comm.get_comm_counts()[c10d.reduce_scatter_tensor], 1)
        self.assertEqual(rs.full_tensor(), a @ b)
        self._test_op_on_dtensor(torch.sum, distribute_tensor(a, mesh, [Shard(0)]))
        self._test_op_on_dtensor(lambda t: t.softmax(dim=0), distribute_tensor(a, mesh, [Shard(0)]))
        self._test_op_on_dtensor(lambda t: t.max(dim=1).values, distribute_tensor(a, mesh, [Shard(1)]))
        self._test_op_on_dtensor(lambda t: t.mean(), distribute_tensor(b, mesh, [Shard(1)]))


if __name__ == "__main__":
    run_tests()
