# flatshard_target_defaults(<target>): what every flatshard target compiles with, in one place.
# - The warning set (CXX only: the library also compiles CUDA sources, which nvcc would reject).
# - The precompiled header cmake/pch.h (LibTorch's headers are most of each file's compile
#   time): built once by the library, `flatshard`, and reused by every other target. Reuse needs
#   the same compile flags, which each target gets by linking flatshard::flatshard.
function(flatshard_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>)
  if(target STREQUAL "flatshard")
    target_precompile_headers(${target} PRIVATE ${PROJECT_SOURCE_DIR}/cmake/pch.h)
  else()
    target_precompile_headers(${target} REUSE_FROM flatshard)
  endif()
endfunction()
