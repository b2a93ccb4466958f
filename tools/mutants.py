"""The mutants ``tools/mutate.py`` applies to hyperdsd: small, realistic bugs.

Each is one textual edit of one module: ``target`` must occur exactly once
in ``hyperdsd/{file}`` (``tests/test_mutants.py`` checks that it still
does), ``replacement`` takes its place, ``bug`` says what the edit models.
``hints`` are ``-k`` patterns of the cases most likely to kill it, run
before anything else so that most mutants die within seconds.

Targets are kept to a line or two, so that when the sources move a broken
target is found by the test and fixed by hand in a minute.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # under hyperdsd/, e.g. "state/optimizer.py"
    target: str
    replacement: str
    bug: str
    hints: tuple[str, ...] = ()


MUTANTS: tuple[Mutant, ...] = (
    # -- get: purity and aliasing ---------------------------------------------
    Mutant(
        "get-steps-fresh-optimizer",
        "state/optimizer.py",
        "        template = template_state(opt) if not opt.state else (stateless_template(opt) if to_load else {})\n",
        "        template = {}\n"
        "        if not opt.state:  # initialise state as torch's get does: zero grads, a step at lr 0\n"
        "            lrs = [g['lr'] for g in opt.param_groups]\n"
        "            for g in opt.param_groups:\n"
        "                g['lr'] = 0.0\n"
        "                for p in g['params']:\n"
        "                    if p.grad is None:\n"
        "                        p.grad = torch.zeros_like(p)\n"
        "            opt.step()\n"
        "            for g, lr in zip(opt.param_groups, lrs):\n"
        "                g['lr'] = lr\n"
        "            opt.zero_grad(set_to_none=True)\n",
        "get initialises a never-stepped optimizer's real state (a zero-gradient step) instead of a template on a copy",
        ("OPT-PURE-1[single-adamw-sharded-fresh]",),
    ),
    Mutant(
        "get-template-on-real-params",
        "state/placeholders.py",
        '        groups.append({**group, "params": [stand_ins[p] for p in mine]})',
        '        groups.append({**group, "params": mine})',
        "the template's scratch optimizer is built over the real parameters (their gradients step them)",
        ("OPT-PURE-1[single-adamw-sharded-grads]",),
    ),
    Mutant(
        "get-aliases-state-entries",
        "state/optimizer.py",
        "                    state[fqn] = _entry_copy(entry)",
        "                    state[fqn] = entry",
        "get returns the optimizer's own per-parameter state dicts (changing the result changes the optimizer)",
        ("OPT-PURE-2[single-adamw-sharded]",),
    ),
    Mutant(
        "get-sorts-group-params",
        "state/optimizer.py",
        '            groups.append({**{k: _own(v) for k, v in g_sd.items() if k != "params"}, "params": fqns})',
        '            groups.append({**{k: _own(v) for k, v in g_sd.items() if k != "params"}, "params": sorted(fqns)})',
        "param_groups list FQNs sorted by name, not in the optimizer's parameter order",
        ("OPT-KEYS-1[single-adamw-sharded]",),
    ),
    Mutant(
        "get-drops-frozen-state",
        "state/optimizer.py",
        "                entry = stored.get(key) or (template.get(p) if template else None)",
        "                entry = (stored.get(key) or (template.get(p) if template else None))"
        " if p.requires_grad else None",
        "get leaves out the optimizer state of parameters frozen after training",
        ("OPT-PART-3[single-sharded]",),
    ),
    # -- keys -----------------------------------------------------------------
    Mutant(
        "prefix-left-compile",
        "state/fqn.py",
        '        hidden.add("_orig_mod")',
        "        pass",
        "torch.compile's _orig_mod. segment is left in FQNs",
        ("OPT-KEYS-2[single-sharded-compile]",),
    ),
    Mutant(
        "prefix-left-missing-keys",
        "state/model.py",
        "    plan.missing = [c for c in raw_of if c not in matched and c not in frozen]",
        "    plan.missing = [raw_of[c] for c in raw_of if c not in matched and c not in frozen]",
        "set_model_state_dict reports missing keys with the wrapper's prefix (raw state-dict keys)",
        ("MODEL-2[ddp-sharded-nonstrict]",),
    ),
    Mutant(
        "ignore-frozen-ignored",
        "state/model.py",
        "    if ignore_frozen:\n",
        "    if False:\n",
        "ignore_frozen_params has no effect on get_model_state_dict",
        ("OPT-PART-3[single-sharded]",),
    ),
    # -- set: in place, dtypes, DTensors -----------------------------------------
    Mutant(
        "set-replaces-state-tensors",
        "state/optimizer.py",
        "        if value.dest is not None:  # planned to fit (checked when planned)\n"
        "            return copy_into(value.dest, value)\n"
        "        return copy_into(existing, value) if fits(existing, value) else materialize(value)",
        "        return materialize(value)",
        "set replaces existing state tensors instead of copying into them (planned fits included)",
        ("OPT-DT-4[single-adamw-sharded]",),
    ),
    Mutant(
        "state-cast-to-param-dtype",
        "state/optimizer_load.py",
        "    verdict = _verdict(value, p, key, expected, verdicts)\n",
        '    if isinstance(value, torch.Tensor) and key != "step":\n'
        "        value = value.to(p.dtype)  # state follows its parameter's dtype\n"
        "    verdict = _verdict(value, p, key, expected, verdicts)\n",
        "state is cast to the parameter's dtype on set (fp32 moments of bf16 parameters become bf16)",
        ("OPT-DT-3[single-adamw-sharded]",),
    ),
    Mutant(
        "fits-ignores-dtype",
        "state/load_plan.py",
        '    return Verdict("", layout, moves, fits and existing.dtype == dtype)',
        '    return Verdict("", layout, moves, fits)',
        "set copies into an existing state tensor of another dtype (the loaded state takes the old dtype)",
        ("OPT-DT-3[single-adamw-sharded]",),
    ),
    Mutant(
        "plain-tensors-after-set",
        "state/load_plan.py",
        "    return prepared.layout.wrap(local) if prepared.layout is not None else local",
        "    return local",
        "new state (and meta-initialised parameters) become plain local tensors instead of DTensors",
        ("OPT-DT-3[fsdp4-adamw-full]",),
    ),
    # -- validation and agreement -------------------------------------------------
    Mutant(
        "validation-skipped-on-rank-1",
        "state/optimizer_load.py",
        "    if shape not in allowed:",
        "    if shape not in allowed and not (torch.distributed.is_initialized()"
        " and torch.distributed.get_rank() == 1):",
        "the shape check is skipped on one rank (rank 1)",
        ("OPT-ATOM-4[fsdp2-sharded]",),
    ),
    Mutant(
        "problems-raised-locally",
        "transport/collectives.py",
        "    if flags[0]:\n        raise_if_any(exchange(problems, group), what, group)",
        "    if problems:\n        raise StateDictError(_format(what, {global_rank(): problems}))",
        "only the rank that found a problem raises; the others load",
        ("OPT-ATOM-4[fsdp2-sharded]",),
    ),
    Mutant(
        "strict-foreign-fqn-accepted",
        "state/optimizer_load.py",
        "        if plan.foreign and not foreign_ok:",
        "        if False:",
        "strict=True accepts FQNs the model does not have",
        ("OPT-ATOM-1[single-sharded-unknown_fqn]",),
    ),
    Mutant(
        "strict-lazy-counts-as-missing",
        "state/optimizer_load.py",
        "        absent = [f for f in required if f not in listed]",
        "        absent = [f for f in required if f not in listed or f not in source.by_name]",
        "strict=True rejects parameters that are listed without state (lazy state counts as missing)",
        ("OPT-PART-2[single-sharded]",),
    ),
    Mutant(
        "strict-false-ignored-for-optimizer",
        "api.py",
        '                self.index, self.optims, parts["optim"], strict=self.opts.strict, foreign_ok=foreign_ok',
        '                self.index, self.optims, parts["optim"], strict=True, foreign_ok=foreign_ok',
        "strict=False is not honoured by set_optimizer_state_dict",
        ("OPT-PART-1[single-sharded-nonstrict]",),
    ),
    Mutant(
        "bcast-check-wrong-error-type",
        "options.py",
        '        raise StateDictError("options.broadcast_from_rank0=True requires full_state_dict=True")',
        '        raise RuntimeError("options.broadcast_from_rank0=True requires full_state_dict=True")',
        "contradictory options raise an error that is not a ValueError",
        ("OPT-ATOM-3[single-optim]",),
    ),
    Mutant(
        "flat-unknown-keys-dropped",
        "state/flat.py",
        "        if split is None:\n            unknown.append(key)\n",
        "        if split is None:\n",
        "flat keys that match no FQN of the model are silently dropped",
        ("OPT-ATOM-1[single-flat-unknown_fqn]",),
    ),
    Mutant(
        "bcast-strict-unowned-ignored",
        "agreement.py",
        "            by_rank = [p + extra for p in by_rank]",
        "            pass",
        "broadcast loads with strict=True accept keys that no rank loads",
        ("MODEL-2[fsdp4-bcast-strict]",),
    ),
    # -- groups ---------------------------------------------------------------------
    Mutant(
        "empty-groups-misordered",
        "state/optimizer_input.py",
        "    for i, j in zip(empty_t, empty_s):",
        "    for i, j in zip(empty_t, reversed(empty_s)):",
        "groups without parameters are paired with the checkpoint's in reverse order",
        ("OPT-EMPTY-1[pp2xfsdp2-adamw-bcast]",),
    ),
    Mutant(
        "flat-drops-initial-lr",
        "state/flat.py",
        '        fields = [(k, v) for k, v in group.items() if k != "params"]',
        '        fields = [(k, v) for k, v in group.items() if k not in ("params", "initial_lr")]',
        "the flat layout drops one group field (initial_lr)",
        ("OPT-SCHED-1[single-adamw-flat]",),
    ),
    Mutant(
        "full-cpu-drops-empty-groups",
        "transport/consolidate.py",
        '    mine["param_groups"] = [g for g in groups if any(f in rooted for f in g["params"])'
        ' or (not g["params"] and rooted)]',
        '    mine["param_groups"] = [g for g in groups if any(f in rooted for f in g["params"])]',
        "full_cpu with pipeline stages drops groups without parameters",
        ("OPT-EMPTY-1[pp2-adamw-full_cpu]",),
    ),
    Mutant(
        "flat-template-fields-untracked",
        "api.py",
        "            placeholders.track_template_fields(nested, anchor)",
        "            pass",
        "a flat template's own group fields count as loaded (a DCP load that did not cover them lists them)",
        ("OPT-PART-1[pp2xfsdp2-dcp-strict_same_hparams]",),
    ),
    # -- placeholders ---------------------------------------------------------------
    Mutant(
        "placeholders-loaded-as-state",
        "state/optimizer_load.py",
        "            written = {k: v for k, v in (entry or {}).items() if k not in skip}",
        "            written = dict(entry or {})",
        "a placeholder nobody wrote into is loaded as real state",
        ("OPT-RT-4[hsdp2x2-adamw-dcp]",),
    ),
    Mutant(
        "placeholder-version-ignored",
        "state/placeholders.py",
        "    return entry is not None and entry[0]() is value and _compat.version_of(value) == entry[1]",
        "    return entry is not None and entry[0]() is value",
        "a placeholder DCP wrote into still counts as unwritten (the loaded state is dropped)",
        ("OPT-RT-1[single-adamw-dcp]",),
    ),
    Mutant(
        "empty-shard-placeholders-written",
        "state/placeholders.py",
        "    if empty and (len(unwritten) < holding or unknown):",
        "    if empty:",
        "empty shards of an unwritten template entry count as written (the rank loads empty state)",
        ("OPT-RESHARD-2[fsdp2_to_fsdp4-adamw-dcp-subset]",),
    ),
    Mutant(
        "empty-shard-decides-alone",
        "state/load_plan.py",
        "            asked = self.questions.get(load.fqn, True) is None or load.fqn in self.confirm",
        "            asked = load.fqn in self.confirm",
        "a rank holding an empty shard of a template entry ignores what the other ranks say about it",
        ("OPT-RESHARD-2[fsdp2_to_fsdp4-sgd-dcp-aux]",),
    ),
    Mutant(
        "saved-template-loads-as-state",
        "state/optimizer_load.py",
        "                plan.questions[fqn] = not expectation.saved_template(p, entry)",
        "                plan.questions[fqn] = True",
        "a never-stepped optimizer's template, saved before the first step, loads as real state",
        ("OPT-RT-5[single-adamw-sharded-step0]", "OPT-PART-3[single-sharded-step0]"),
    ),
    Mutant(
        "saved-template-keeps-warm-state",
        "state/optimizer.py",
        "            load.opt.state.pop(load.param, None)",
        "            pass",
        "an entry that says 'never stepped' leaves a stepped target's own state in place",
        ("OPT-RT-5[single-adamw-sharded-step0]",),
    ),
    Mutant(
        "stepless-template-loads-as-state",
        "state/optimizer_load.py",
        "    if not expectation.stepless_template([(p, entry) for p, _, entry in found]):",
        "    if True:",
        "a never-stepped SGD-with-momentum template (zero buffers, no step), saved before the first step, loads as "
        "real state",
        ("OPT-RT-5[single-sgd-sharded-step0]", "OPT-RT-1[single-sgd-full-step0]"),
    ),
    Mutant(
        "step-placeholder-not-zeroed",
        "state/placeholders.py",
        '                value.zero_()  # a placeholder that is saved as is means "never stepped"',
        "                pass",
        "a never-stepped optimizer's template says step 1, as after the scratch step",
        ("OPT-RT-1[fsdp4-adamw-full-step0]",),
    ),
    # -- shards, gathers, broadcasts ------------------------------------------------------
    Mutant(
        "shard-size-rounded-down",
        "placement.py",
        "    size = -(-length // parts) if length else 0",
        "    size = length // parts if length else 0",
        "uneven shards are sized with floor division (torch.chunk rounds up)",
        ("OPT-RT-1[fsdp3-adamw-full]",),
    ),
    Mutant(
        "empty-shard-offset-off-by-one",
        "placement.py",
        "    start = min(index * size, length)",
        "    start = min(index * size, length - 1)",
        "the offset of a trailing empty shard is off by one (it gets the last row)",
        ("OPT-RT-1[fsdp4-adamw-full]",),
    ),
    Mutant(
        "slices-wrong-mesh-coordinate",
        "placement.py",
        "self.mesh.size(mesh_dim), coordinate[mesh_dim]\n",
        "self.mesh.size(mesh_dim), coordinate[0]\n",
        "on a 2-D mesh a rank's shard is cut by its coordinate on the first mesh dim",
        ("OPT-RT-1[hsdp2x2-adamw-full]",),
    ),
    Mutant(
        "gather-piece-rows-rounded-down",
        "transport/gather.py",
        "        rows = -(-shape[item.shard_dim] // n) if shape[item.shard_dim] else 0",
        "        rows = shape[item.shard_dim] // n",
        "gather buckets size uneven pieces with floor division (pieces overlap)",
        ("OPT-RT-1[fsdp3-adamw-full]",),
    ),
    Mutant(
        "gather-shard-on-mesh-dim-0",
        "transport/gather.py",
        "            found = (i, p.dim)",
        "            found = (0, p.dim)",
        "gathers assume the shard mesh dim is the first (wrong group under HSDP)",
        ("OPT-RT-1[hsdp2x2-adamw-full_cpu]",),
    ),
    Mutant(
        "full-cpu-model-on-every-rank",
        "transport/consolidate.py",
        "    root_only = cpu and group.has_peers\n    kept, roots = full_entries(sd, group,",
        "    root_only = False  # every rank keeps what it gathered\n    kept, roots = full_entries(sd, group,",
        "full_state_dict + cpu_offload gives every rank the model's full dict, not the root alone",
        ("MODEL-1[fsdp2-full_cpu]",),
    ),
    Mutant(
        "full-cpu-stages-not-collected",
        "transport/consolidate.py",
        "    if root_only and group.has_peers and not collectives.same_everywhere(keys, group):",
        "    if False:",
        "full_cpu assumes every rank holds the same keys (the root misses other pipeline stages)",
        ("OPT-RT-3[pp2-adamw-full_cpu]",),
    ),
    Mutant(
        "full-cpu-stage-groups-dropped",
        "transport/consolidate.py",
        '            mine["param_groups"].extend(part["param_groups"])',
        "            pass",
        "full_cpu with pipeline stages: the root receives the other stages' state but not their param groups",
        ("OPT-RT-1[pp2-adamw-full_cpu]",),
    ),
    Mutant(
        "bcast-piece-cut-twice",
        "transport/delivery.py",
        "            u.receive(piece)  # the region this one user needs",
        "            u.receive(u.layout.local_from_full(piece) if u.layout is not None else piece)",
        "a broadcast piece that is already this rank's region is cut again",
        ("OPT-RT-1[fsdp2-adamw-bcast]",),
    ),
    # -- model -----------------------------------------------------------------------
    Mutant(
        "model-extra-state-dropped",
        "state/model.py",
        "            plan.values[raw] = value  # extra state: whatever the module accepts",
        "            pass",
        "set_model_state_dict drops extra state",
        ("MODEL-5[fsdp2-sharded-dict]",),
    ),
    Mutant(
        "model-meta-not-assigned",
        "state/model.py",
        "        if raw in plan.on_meta:",
        "        if False:",
        "parameters on the meta device are copied into (a no-op) instead of assigned",
        ("MODEL-4[fsdp2-full]",),
    ),
    # -- the model's group (group.py) -------------------------------------------------
    Mutant(
        "group-root-is-global-rank-0",
        "transport/group.py",
        "        return self.ranks[0]",
        "        return 0",
        "the root of full_cpu and broadcast loads is global rank 0 even for a model on other ranks",
        ("OPT-MESH-2[halves2+2-adamw-full_cpu]",),
    ),
    Mutant(
        "group-slices-not-rooted",
        "transport/group.py",
        "            root = _compat.root_mesh(p.device_mesh)",
        "            root = p.device_mesh",
        "meshes are compared as they are, not by their root: "
        "a stage sliced from a pp x dp mesh is taken for a model of its own",
        ("OPT-RT-1[pp2xfsdp2-adamw-full_cpu]",),
    ),
    # -- DCP load planner (checkpoint.py, checkpoint_plan.py) ---------------------------
    Mutant(
        "dcp-flat-lazy-fields-dropped",
        "state/dcp_template.py",
        '            if entry.fields and not _keys_under(ordered, entry.fields_prefix + "."):',
        "            if entry.fields:",
        "flat layout: a lazy parameter's group fields are left out of the load even where the checkpoint holds them",
        ("OPT-PART-2[pp2xfsdp2-dcp]",),
    ),
    Mutant(
        "dcp-coordinator-own-keys",
        "checkpoint.py",
        "            asked.update(keys)",
        "            asked.update(self.asked)",
        "the coordinator judges unexpected checkpoint entries by its own state dict "
        "(other stages' entries look unexpected)",
        ("OPT-RT-1[pp2-adamw-dcp]",),
    ),
    Mutant(
        "dcp-unexpected-entries-ignored",
        "checkpoint.py",
        "        if extra:\n",
        "        if False:\n",
        "strict DCP loads ignore checkpoint entries no rank asks for (a checkpoint with a param group more loads)",
        ("OPT-ATOM-1[single-dcp-extra_empty_group]",),
    ),
    Mutant(
        "dcp-planner-always-partial",
        "checkpoint.py",
        "        super().__init__(allow_partial_load=not strict)",
        "        super().__init__(allow_partial_load=True)",
        "strict DCP loads skip template entries the checkpoint lacks (they keep the target's values)",
        ("OPT-ATOM-1[single-dcp-missing_empty_group]",),
    ),
    # -- nested state (custom optimizers) -------------------------------------------------
    Mutant(
        "nested-containers-shared",
        "state/optimizer.py",
        "    return {k: v if isinstance(v, torch.Tensor) or not is_container(v) else rebuild(v, _same)"
        " for k, v in entry.items()}",
        "    return dict(entry)",
        "get copies state entries but not the dicts and lists nested in them (changing those changes the optimizer)",
        ("OPT-PURE-2[single-custom-sharded]",),
    ),
    Mutant(
        "nested-tensors-not-redistributed",
        "state/load_plan.py",
        "                elif is_container(v):\n",
        "                elif False:\n",
        "tensors nested in state (dicts and lists) are left out of the load's redistribution",
        ("OPT-STATE-1[hsdp2x2-custom-full_cpu]",),
    ),
    Mutant(
        "nested-placeholders-unmarked",
        "state/placeholders.py",
        "            for t in _tensors(value):\n                mark_placeholder(t)",
        "            if isinstance(value, torch.Tensor):\n                mark_placeholder(value)",
        "a never-stepped optimizer's template marks only top-level tensors as placeholders "
        "(nested ones count as real state)",
        ("OPT-STATE-1[single-custom-dcp-lazy]",),
    ),
    # -- warm loads and the broadcast's bytes (SPEC 1.2) ------------------------------
    Mutant(
        "warm-load-keeps-step",
        "state/optimizer.py",
        "        new = {key: _loaded(value, (current or {}).get(key)) for key, value in load.entry.items()}",
        "        new = {key: current[key] if key == 'step' and current and key in current and current[key] > 0\n"
        "               else _loaded(value, (current or {}).get(key)) for key, value in load.entry.items()}",
        "a load into an optimizer that has stepped keeps its own step count (the rest of its state is loaded)",
        ("OPT-RT-5[single-adamw-sharded]",),
    ),
    Mutant(
        "dcp-partial-loaded-into-warm",
        "state/dcp_template.py",
        "        if present:\n",
        "        if present and not entry.placeholder:\n"
        "            drop += missing  # a stepped optimizer has the rest: load what is there\n"
        "            continue\n"
        "        if present:\n",
        "DCP loads into a stepped optimizer take what the checkpoint has of a partly present entry (the target keeps "
        "its own exp_avg_sq or step beside the checkpoint's exp_avg)",
        ("OPT-PART-6[single-dcp-no_exp_avg_sq-warm]",),
    ),
    Mutant(
        "bcast-whole-tensors",
        "transport/delivery.py",
        "        if p.layout is not None and p.layout.simple:\n",
        "        if False:\n",
        "broadcast loads send every rank whole tensors, each rank cutting its own shard (as torch's do)",
        ("MODEL-3[fsdp2-bcast]",),
    ),
    # -- beyond the fixed matrix (issue 25): sizes, features together ------------------------------------
    # Each is wrong only in a scenario no fixed case builds; the matrix passes them (docs/MUTATION.md),
    # generated scenarios (python -m conformance explore) can reach them. Their hints are the nearest
    # fixed cases, which they pass.
    Mutant(
        "shard-start-unclamped",
        "placement.py",
        "    start = min(index * size, length)",
        "    start = index * size",
        "a shard's start is not clamped to the length: wrong (a negative size) for a shard that starts past the end, "
        "which takes a tensor of 1, 2 or 5 rows on 4 ranks or 1 on 3 (of the fixed models only MODEL-3's tiny has one)",
        ("MODEL-3[fsdp4-bcast-tiny]",),
    ),
    Mutant(
        "one-element-state-left-plain",
        "state/optimizer_load.py",
        "    sharded = isinstance(p, DTensor) and shape == tuple(p.shape) and shape != ()",
        "    sharded = isinstance(p, DTensor) and shape == tuple(p.shape) and shape not in ((), (1,))",
        "a one-element state value is taken for a scalar (as older checkpoints stored step) and left plain: the state "
        "of a one-element parameter is not sharded on load (of the fixed models only MODEL-3's tiny one has such a "
        "parameter, and MODEL-3 loads no optimizer)",
        ("OPT-RT-1[fsdp4-adamw-full]", "OPT-RT-1[fsdp2-adamw-bcast]"),
    ),
    Mutant(
        "tied-alias-dropped-with-extra-state",
        "state/model.py",
        "        raw = model.state_dict(keep_vars=True)\n",
        "        raw = model.state_dict(keep_vars=True)\n"
        "        seen: set[int] = set()  # a tied tensor once, under its first name\n"
        "        raw = {\n"
        "            k: v\n"
        "            for k, v in raw.items()\n"
        "            if not (isinstance(v, torch.Tensor) and (id(v) in seen or seen.add(id(v))))\n"
        "        }\n",
        "the model's state_dict() path (taken when a module has extra state) lists a tied weight once, under its first "
        "name: wrong only for a tied model with extra state (the suite ties models without extra state)",
        ("MODEL-5[fsdp2-full-tensor]", "OPT-KEYS-3[single-full]"),
    ),
    Mutant(
        "stage-extra-state-not-sent-to-root",
        "transport/consolidate.py",
        "        received = collectives.send_to_root(kept if not group.is_root else None, group)",
        "        tensors = {k: v for k, v in kept.items() if isinstance(v, torch.Tensor)}\n"
        "        received = collectives.send_to_root(tensors if not group.is_root else None, group)",
        "full_cpu with pipeline stages: the other stages send the root their tensors only, so extra state that is not "
        "a tensor (a dict, an object) of a later stage is missing (the suite has extra state only on fsdp2)",
        ("MODEL-5[fsdp2-full_cpu-dict]", "MODEL-1[pp2-full_cpu]"),
    ),
    Mutant(
        "extra-state-key-not-canonical",
        "state/model.py",
        "            index.canonical_key(k): _compat.detached(v)\n",
        "            (index.canonical_key(k) if isinstance(v, torch.Tensor) else k): _compat.detached(v)\n",
        "get_model_state_dict canonicalises the keys of tensors only: extra state that is not a tensor keeps a "
        "wrapper's prefix (DDP's module.); wrong only for a wrapped model with extra state (the suite has extra "
        "state only on fsdp2, which renames nothing)",
        ("MODEL-5[fsdp2-sharded-dict]", "MODEL-1[ddp-sharded]"),
    ),
    Mutant(
        "groups-paired-by-position",
        "state/optimizer_input.py",
        "    if len(targets) == len(sources) and all(set(t.fqns) == set(s.fqns) for t, s in zip(targets, sources)):",
        "    if len(targets) == len(sources):  # as many groups as the optimizer: taken to be the same ones, in order",
        "a checkpoint with as many groups as the optimizer is paired with it group by group, by position: wrong "
        "when the optimizer lists its groups in another order than the checkpoint (every fixed case loads into "
        "groups in the source's order)",
        ("OPT-KEYS-4[single-sharded]", "OPT-ATOM-1[single-sharded-unknown_group]", "OPT-PART-1[single-sharded-strict]"),
    ),
)


def by_name() -> dict[str, Mutant]:
    return {m.name: m for m in MUTANTS}
