// A restricted reader for the NumPy object arrays that NeMo's packed SFT files (and the MLPerf Llama-2 70B
// LoRA data as NVIDIA ships it) are: `.npy` files whose payload is a pickle. It is NOT an unpickler: it
// evaluates only the opcodes that plain containers and NumPy arrays need (protocols 2-5: integers, bools,
// None, str, bytes, lists, tuples, dicts, the memo) and calls exactly three globals —
// numpy.core.multiarray._reconstruct (also numpy._core.multiarray), numpy.ndarray and numpy.dtype — as
// data constructors, never as code. Any other opcode or global (os.system, builtins.eval, ...), a
// malformed stream or a structure outside that layout is a UserError naming the file and the byte offset.
// Private to the data layer.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::npy {

struct Value;
using ValuePtr = std::shared_ptr<Value>;

// A NumPy array: its shape, dtype ("i8", "u1", "b1", "O", ...) and either raw little-endian data or, for
// dtype O, its objects.
struct Array {
  std::vector<int64_t> shape;
  std::string dtype;  // numpy's kind+size, e.g. "i8"; "O" for objects
  char byteorder = '<';
  std::string data;               // numeric arrays
  std::vector<ValuePtr> objects;  // object arrays
  int64_t numel() const;
};

struct Value {
  enum class Kind { kNone, kBool, kInt, kStr, kBytes, kList, kTuple, kDict, kArray, kDtype, kGlobal, kMark };
  Kind kind = Kind::kNone;
  bool b = false;
  int64_t i = 0;
  std::string s;                      // kStr, kBytes, kDtype (its str), kGlobal (module.name)
  std::vector<ValuePtr> items;        // kList, kTuple
  std::map<std::string, ValuePtr> dict;  // kDict (string keys only)
  std::shared_ptr<Array> array;       // kArray
};

// The array stored in `path` (an .npy file: magic, header, then raw data or, for dtype O, the pickle).
Array load_npy(const std::string& path);

// An integer list out of a list of ints/bools, or a 1-D integer/bool array; UserError naming `what`.
std::vector<int64_t> int_list(const Value& v, const std::string& what);

}  // namespace loom::npy
