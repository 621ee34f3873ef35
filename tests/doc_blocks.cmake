# The C++ blocks of README.md and docs/*.md, compiled as pasted (issue 32 item 5).
#
# Convention: a ```cpp block is a complete translation unit (its own #includes; it defines
# functions and has no main), unless the line directly before its fence is
#   <!-- doc-test: fragment -->
# which marks a fragment on purpose: it is skipped by that marker, never by accident.
#
# Used two ways:
# - include()d by tests/CMakeLists.txt at configure time: flatshard_extract_doc_blocks() writes
#   every unmarked block to <build>/tests/generated/doc_blocks/<file>_<n>.cpp (n counts the
#   file's ```cpp blocks from 1, fragments included) with a "// from <file>, block n, line L"
#   comment and a #line directive, so a compiler error names the .md file and its line.
# - as a script (cmake -P tests/doc_blocks.cmake, the doc_blocks_check test): DOC_ROOT (the
#   source tree: its README.md and docs/*.md) and DOC_GENERATED (the folder above): fails if no
#   block was extracted, a marker is not followed by a ```cpp fence, or the .md files now hold
#   another number of blocks than were generated (configure is stale).

# The line number (1-based) at byte offset `offset` of `text`.
function(_flatshard_line_at text offset out)
  string(SUBSTRING "${text}" 0 ${offset} _prefix)
  string(REGEX REPLACE "[^\n]" "" _newlines "${_prefix}")
  string(LENGTH "${_newlines}" _n)
  math(EXPR _n "${_n} + 1")
  set(${out} ${_n} PARENT_SCOPE)
endfunction()

# Scans one .md file. Sets in the caller's scope:
#   <prefix>_BLOCKS     offsets of the ```cpp fences that start a line, in order
#   <prefix>_FRAGMENT   per block: 1 if the line before its fence is the marker, else 0
#   <prefix>_BAD        line numbers of markers not directly followed by a ```cpp fence
# (C++ code is never put in a CMake list: only offsets travel.)
set(_FLATSHARD_DOC_MARKER "<!-- doc-test: fragment -->")
# <out>: the offsets of every occurrence of `needle` in `text`, in order.
function(_flatshard_find_all text needle out)
  set(_found "")
  string(LENGTH "${text}" _len)
  string(LENGTH "${needle}" _nlen)
  set(_at 0)
  while(_at LESS _len)
    string(SUBSTRING "${text}" ${_at} -1 _rest)
    string(FIND "${_rest}" "${needle}" _i)
    if(_i LESS 0)
      break()
    endif()
    math(EXPR _off "${_at} + ${_i}")
    list(APPEND _found ${_off})
    math(EXPR _at "${_off} + ${_nlen}")
  endwhile()
  set(${out} "${_found}" PARENT_SCOPE)
endfunction()
function(_flatshard_scan_md text prefix)
  set(_blocks "")
  set(_fragment "")
  set(_bad "")
  # Fences: "```cpp" at the start of a line and at the end of it.
  _flatshard_find_all("${text}" "```cpp\n" _fences)
  foreach(_off IN LISTS _fences)
    set(_line_start FALSE)
    if(_off EQUAL 0)
      set(_line_start TRUE)
    else()
      math(EXPR _prev "${_off} - 1")
      string(SUBSTRING "${text}" ${_prev} 1 _c)
      if(_c STREQUAL "\n")
        set(_line_start TRUE)
      endif()
    endif()
    if(NOT _line_start)
      continue()
    endif()
    list(APPEND _blocks ${_off})
    # The line before the fence.
    set(_is_fragment 0)
    if(_off GREATER 1)
      math(EXPR _end "${_off} - 1")  # the "\n" ending the previous line
      string(SUBSTRING "${text}" 0 ${_end} _before)
      string(FIND "${_before}" "\n" _nl REVERSE)
      math(EXPR _nl "${_nl} + 1")
      string(SUBSTRING "${_before}" ${_nl} -1 _prev_line)
      string(STRIP "${_prev_line}" _prev_line)
      if(_prev_line STREQUAL _FLATSHARD_DOC_MARKER)
        set(_is_fragment 1)
      endif()
    endif()
    list(APPEND _fragment ${_is_fragment})
  endforeach()
  # Markers: each must be followed, on the next line, by a ```cpp fence.
  string(LENGTH "${_FLATSHARD_DOC_MARKER}" _mlen)
  _flatshard_find_all("${text}" "${_FLATSHARD_DOC_MARKER}" _markers)
  foreach(_off IN LISTS _markers)
    math(EXPR _after "${_off} + ${_mlen}")
    string(SUBSTRING "${text}" ${_after} 8 _next)
    if(NOT _next STREQUAL "\n```cpp\n")
      _flatshard_line_at("${text}" ${_off} _line)
      list(APPEND _bad ${_line})
    endif()
  endforeach()
  set(${prefix}_BLOCKS "${_blocks}" PARENT_SCOPE)
  set(${prefix}_FRAGMENT "${_fragment}" PARENT_SCOPE)
  set(${prefix}_BAD "${_bad}" PARENT_SCOPE)
endfunction()

# "README.md" -> "README", "docs/hsdp.md" -> "docs_hsdp".
function(_flatshard_doc_stem rel out)
  string(REGEX REPLACE "\\.md$" "" _s "${rel}")
  string(REPLACE "/" "_" _s "${_s}")
  set(${out} "${_s}" PARENT_SCOPE)
endfunction()

# Writes the unmarked blocks of `files` (absolute paths under `root`) into `out_dir`; sets
# <out_var> to the generated sources and <out_var>_FRAGMENTS to the number of marked blocks.
# A file is rewritten only when its text changes (so a reconfigure rebuilds only what moved),
# and generated files of blocks that no longer exist are removed.
function(flatshard_extract_doc_blocks root out_dir out_var)
  set(_files ${ARGN})
  file(MAKE_DIRECTORY "${out_dir}")
  set(_sources "")
  set(_fragments 0)
  foreach(_md IN LISTS _files)
    file(RELATIVE_PATH _rel "${root}" "${_md}")
    _flatshard_doc_stem("${_rel}" _stem)
    file(READ "${_md}" _text)
    _flatshard_scan_md("${_text}" _scan)
    foreach(_line IN LISTS _scan_BAD)
      message(FATAL_ERROR "${_rel}:${_line}: '${_FLATSHARD_DOC_MARKER}' must be the line "
                          "directly before a ```cpp fence (tests/doc_blocks.cmake)")
    endforeach()
    set(_n 0)
    foreach(_off IN LISTS _scan_BLOCKS)
      list(GET _scan_FRAGMENT ${_n} _is_fragment)
      math(EXPR _n "${_n} + 1")
      if(_is_fragment)
        math(EXPR _fragments "${_fragments} + 1")
        continue()
      endif()
      math(EXPR _begin "${_off} + 7")
      string(SUBSTRING "${_text}" ${_begin} -1 _code)
      string(FIND "${_code}" "\n```" _end)
      if(_end LESS 0)
        _flatshard_line_at("${_text}" ${_off} _line)
        message(FATAL_ERROR "${_rel}:${_line}: ```cpp block ${_n} is never closed")
      endif()
      string(SUBSTRING "${_code}" 0 ${_end} _code)
      _flatshard_line_at("${_text}" ${_off} _fence_line)
      math(EXPR _first "${_fence_line} + 1")
      set(_out "${out_dir}/${_stem}_${_n}.cpp")
      file(WRITE "${_out}.tmp"
           "// from ${_rel}, block ${_n}, line ${_fence_line} (copied by tests/doc_blocks.cmake: "
           "edit the .md, not this file)\n#line ${_first} \"${_md}\"\n${_code}\n")
      configure_file("${_out}.tmp" "${_out}" COPYONLY)  # touches the file only if it changed
      file(REMOVE "${_out}.tmp")
      list(APPEND _sources "${_out}")
    endforeach()
  endforeach()
  file(GLOB _old "${out_dir}/*.cpp")
  foreach(_f IN LISTS _old)
    list(FIND _sources "${_f}" _kept)
    if(_kept LESS 0)
      file(REMOVE "${_f}")
    endif()
  endforeach()
  set(${out_var} "${_sources}" PARENT_SCOPE)
  set(${out_var}_FRAGMENTS ${_fragments} PARENT_SCOPE)
endfunction()

# --- script mode: the doc_blocks_check test ---------------------------------------------------
if(CMAKE_SCRIPT_MODE_FILE AND CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  set(_errors 0)
  set(_blocks 0)
  set(_fragments 0)
  file(GLOB _pages "${DOC_ROOT}/docs/*.md")
  foreach(_md IN ITEMS "${DOC_ROOT}/README.md" ${_pages})
    file(READ "${_md}" _text)
    _flatshard_scan_md("${_text}" _scan)
    foreach(_line IN LISTS _scan_BAD)
      message(SEND_ERROR "${_md}:${_line}: '${_FLATSHARD_DOC_MARKER}' is not directly followed "
                         "by a ```cpp fence")
      math(EXPR _errors "${_errors} + 1")
    endforeach()
    foreach(_f IN LISTS _scan_FRAGMENT)
      if(_f)
        math(EXPR _fragments "${_fragments} + 1")
      else()
        math(EXPR _blocks "${_blocks} + 1")
      endif()
    endforeach()
  endforeach()
  file(GLOB _generated "${DOC_GENERATED}/*.cpp")
  list(LENGTH _generated _n_generated)
  message(STATUS "doc blocks: ${_blocks} to compile in the .md files, ${_n_generated} generated "
                 "in ${DOC_GENERATED}, ${_fragments} marked fragments")
  if(_blocks EQUAL 0 OR _n_generated EQUAL 0)
    message(SEND_ERROR "no ```cpp block was extracted from README.md and docs/*.md")
  elseif(NOT _blocks EQUAL _n_generated)
    message(SEND_ERROR "the .md files have ${_blocks} unmarked ```cpp blocks but "
                       "${DOC_GENERATED} holds ${_n_generated}: re-run cmake")
  endif()
endif()
