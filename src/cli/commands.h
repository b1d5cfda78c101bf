// The `strata` subcommands. Each Register* function adds one subcommand to `app` with its options
// and a callback that runs it after a successful parse; the callback stores the command's exit
// code in `*exit_code` (see cli/cli_util.h for the codes). `app` and `exit_code` must outlive
// the parse. The callbacks report their own errors (ReportError) and do not throw.
#pragma once

#include <CLI/CLI.hpp>

namespace strata::cli {

// `strata env`: what this machine offers Strata (CPU, memory, GPUs, io_uring, storage paths).
void RegisterEnvCommand(CLI::App& app, int* exit_code);

// `strata nvme-bench`: measures and tunes NVMe paths for offload.
void RegisterNvmeBenchCommand(CLI::App& app, int* exit_code);

// `strata data`: token data utilities (`strata data synth` writes a synthetic corpus; `strata
// data prepare` tokenizes datasets with a model's tokenizer).
void RegisterDataCommand(CLI::App& app, int* exit_code);
// `strata data prepare`, under `data`.
void RegisterDataPrepareCommand(CLI::App* data, int* exit_code);

// `strata checkpoint`: checkpoint tools (`strata checkpoint verify DIR` checks its checksums).
void RegisterCheckpointCommand(CLI::App& app, int* exit_code);

// `strata estimate`: what a train run would allocate per rank and tier (train/estimate.h).
void RegisterEstimateCommand(CLI::App& app, int* exit_code);

// `strata train`: trains a Llama-family model with the ZeRO engine (train/trainer.h).
void RegisterTrainCommand(CLI::App& app, int* exit_code);

// `strata eval`: the loss and perplexity of a model on a token file (forward only).
void RegisterEvalCommand(CLI::App& app, int* exit_code);

// `strata report METRICS.jsonl [--trace FILE] [--out FILE]`: an HTML page of a training run.
void RegisterReportCommand(CLI::App& app, int* exit_code);

}  // namespace strata::cli
