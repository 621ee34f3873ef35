// Precompiled header for flatshard's own targets: the heavy LibTorch headers everyone includes.
// Keep it narrow (no <torch/torch.h>): every header added here costs every TU.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
