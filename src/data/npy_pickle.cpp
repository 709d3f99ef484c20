// The restricted .npy / pickle reader (data/npy_pickle.h). A stack machine over the opcodes NumPy's object
// arrays use; every length is checked against the bytes left, every opcode and global against an
// allowlist, and REDUCE/BUILD only build the three NumPy data types.
#include "data/npy_pickle.h"

#include <charconv>
#include <cstring>
#include <set>
#include <unordered_map>

#include "loom/core/check.h"
#include "loom/core/file_io.h"

namespace loom::npy {

int64_t Array::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

using Kind = Value::Kind;

ValuePtr make(Kind k) {
  auto v = std::make_shared<Value>();
  v->kind = k;
  return v;
}

// Shapes are bounded so that element counts and byte sizes never overflow: no dimension above 2^40 and
// no more than 2^40 elements in all (far beyond any file that can be read).
constexpr int64_t kMaxElements = int64_t(1) << 40;
bool add_dim(Array& a, int64_t d) {
  if (d < 0 || d > kMaxElements) return false;
  const int64_t before = a.numel();
  if (d != 0 && before > kMaxElements / d) return false;
  a.shape.push_back(d);
  return true;
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kNone: return "None";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kStr: return "str";
    case Kind::kBytes: return "bytes";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kArray: return "numpy array";
    case Kind::kDtype: return "numpy dtype";
    case Kind::kGlobal: return "global";
    case Kind::kMark: return "mark";
  }
  return "?";
}

// Element size of a numeric dtype string ("i8", "u1", "b1", ...); 0 when not an integer/bool type.
int64_t int_itemsize(const std::string& dt) {
  if (dt.size() < 2 || (dt[0] != 'i' && dt[0] != 'u' && dt[0] != 'b')) return 0;
  const int n = std::atoi(dt.c_str() + 1);
  return n == 1 || n == 2 || n == 4 || n == 8 ? n : 0;
}

int64_t read_int_element(const std::string& dt, const char* p) {
  const int64_t n = int_itemsize(dt);
  if (dt[0] == 'i') {
    if (n == 1) return int8_t(p[0]);
    if (n == 2) { int16_t v; std::memcpy(&v, p, 2); return v; }
    if (n == 4) { int32_t v; std::memcpy(&v, p, 4); return v; }
    int64_t v; std::memcpy(&v, p, 8); return v;
  }
  if (n == 1) return uint8_t(p[0]);
  if (n == 2) { uint16_t v; std::memcpy(&v, p, 2); return v; }
  if (n == 4) { uint32_t v; std::memcpy(&v, p, 4); return v; }
  uint64_t v;
  std::memcpy(&v, p, 8);
  return int64_t(v);
}

class Unpickler {
 public:
  Unpickler(const std::string& file, const std::string& data, size_t begin) : file_(file), d_(data), pos_(begin) {}
  // Values a stream made but the result does not hold (the memo, an abandoned parse) may reference each
  // other in cycles (a list appended to itself): empty them so the shared pointers free everything.
  ~Unpickler() {
    for (const ValuePtr& v : all_)
      if (!ok_ || !kept_.count(v.get())) {
        v->items.clear();
        v->dict.clear();
        if (v->array) v->array->objects.clear();
      }
  }

  ValuePtr run() {
    for (;;) {
      const size_t at = pos_;
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;                  // PROTO
        case 0x95: bytes(8); break;              // FRAME (a length hint)
        case '.': {                              // STOP
          if (stack_.size() != 1) fail(at, "STOP with ", stack_.size(), " values on the stack");
          ValuePtr result = pop(at);
          keep(at, result.get(), 0);
          ok_ = true;
          return result;
        }
        case '(': push(mk(Kind::kMark)); break;
        case 'c': {                              // GLOBAL "module\nname\n"
          const std::string mod = line(at), name = line(at);
          push(global(at, mod, name));
          break;
        }
        case 0x93: {                             // STACK_GLOBAL
          const ValuePtr name = pop(at), mod = pop(at);
          if (mod->kind != Kind::kStr || name->kind != Kind::kStr) fail(at, "STACK_GLOBAL needs two strings");
          push(global(at, mod->s, name->s));
          break;
        }
        case 'q': memo_[u8()] = top(at); break;  // BINPUT
        case 'r': memo_[u32()] = top(at); break; // LONG_BINPUT
        case 0x94: memo_[uint32_t(memo_.size())] = top(at); break;  // MEMOIZE
        case 'h': push(get(at, u8())); break;    // BINGET
        case 'j': push(get(at, u32())); break;   // LONG_BINGET
        case ')': push(mk(Kind::kTuple)); break;
        case 't': { auto v = mk(Kind::kTuple); v->items = pop_mark(at); push(v); break; }
        case 0x85: case 0x86: case 0x87: {       // TUPLE1..3
          auto v = mk(Kind::kTuple);
          v->items.resize(size_t(op - 0x84));
          for (size_t k = v->items.size(); k-- > 0;) v->items[k] = pop(at);
          push(v);
          break;
        }
        case ']': push(mk(Kind::kList)); break;
        case 'l': { auto v = mk(Kind::kList); v->items = pop_mark(at); push(v); break; }
        case 'a': { const ValuePtr x = pop(at); list(at)->items.push_back(x); break; }
        case 'e': { auto xs = pop_mark(at); auto& l = list(at)->items; l.insert(l.end(), xs.begin(), xs.end()); break; }
        case '}': push(mk(Kind::kDict)); break;
        case 'd': { auto v = mk(Kind::kDict); set_items(at, *v, pop_mark(at)); push(v); break; }
        case 's': { const ValuePtr val = pop(at), key = pop(at); set_items(at, *dict(at), {key, val}); break; }
        case 'u': { auto kv = pop_mark(at); set_items(at, *dict(at), kv); break; }
        case 'J': { int32_t v; std::memcpy(&v, bytes(4), 4); push(int_value(v)); break; }
        case 'K': push(int_value(u8())); break;
        case 'M': { uint16_t v; std::memcpy(&v, bytes(2), 2); push(int_value(v)); break; }
        case 0x8a: {                             // LONG1: little-endian two's complement
          const uint8_t n = u8();
          if (n > 8) fail(at, "an integer of ", int(n), " bytes (more than 64 bits)");
          const char* p = bytes(n);
          uint64_t v = 0;
          for (int k = 0; k < n; ++k) v |= uint64_t(uint8_t(p[k])) << (8 * k);
          if (n > 0 && n < 8 && (uint8_t(p[n - 1]) & 0x80)) v |= ~uint64_t(0) << (8 * n);
          push(int_value(int64_t(v)));
          break;
        }
        case 'N': push(mk(Kind::kNone)); break;
        case 0x88: case 0x89: { auto v = mk(Kind::kBool); v->b = op == 0x88; push(v); break; }
        case 'X': push(str(Kind::kStr, u32())); break;
        case 0x8c: push(str(Kind::kStr, u8())); break;
        case 0x8d: push(str(Kind::kStr, u64(at))); break;
        case 'C': push(str(Kind::kBytes, u8())); break;
        case 'B': push(str(Kind::kBytes, u32())); break;
        case 0x8e: case 0x96: push(str(Kind::kBytes, u64(at))); break;  // BINBYTES8, BYTEARRAY8
        case 'R': reduce(at); break;
        case 'b': build(at); break;
        default:
          fail(at, "pickle opcode 0x", hex(op), " is not allowed (only plain containers, integers, strings and "
               "NumPy arrays are read; never code)");
      }
    }
  }

 private:
  template <typename... A>
  [[noreturn]] void fail(size_t at, const A&... a) const {
    user_error(file_, ": byte ", at, ": ", a..., " — not the NumPy object-array layout of a packed SFT file");
  }
  static std::string hex(uint8_t b) {
    const char* h = "0123456789abcdef";
    return std::string{h[b >> 4], h[b & 15]};
  }
  const char* bytes(uint64_t n) {
    if (n > d_.size() - pos_) user_error(file_, ": the pickle ends early (needs ", n, " bytes at byte ", pos_, ")");
    const char* p = d_.data() + pos_;
    pos_ += n;
    return p;
  }
  uint8_t u8() { return uint8_t(*bytes(1)); }
  uint32_t u32() { uint32_t v; std::memcpy(&v, bytes(4), 4); return v; }
  uint64_t u64(size_t) { uint64_t v; std::memcpy(&v, bytes(8), 8); return v; }
  std::string line(size_t at) {
    const size_t nl = d_.find('\n', pos_);
    if (nl == std::string::npos || nl - pos_ > 256) fail(at, "GLOBAL without a newline-terminated name");
    std::string s = d_.substr(pos_, nl - pos_);
    pos_ = nl + 1;
    return s;
  }
  ValuePtr str(Kind k, uint64_t n) {
    auto v = make(k);
    const char* p = bytes(n);
    v->s.assign(p, size_t(n));
    return v;
  }
  ValuePtr int_value(int64_t x) {
    auto v = mk(Kind::kInt);
    v->i = x;
    return v;
  }
  void push(ValuePtr v) { stack_.push_back(std::move(v)); }
  ValuePtr pop(size_t at) {
    if (stack_.empty() || stack_.back()->kind == Kind::kMark) fail(at, "stack underflow");
    ValuePtr v = stack_.back();
    stack_.pop_back();
    return v;
  }
  const ValuePtr& top(size_t at) {
    if (stack_.empty()) fail(at, "memo store on an empty stack");
    return stack_.back();
  }
  ValuePtr get(size_t at, uint32_t k) {
    const auto it = memo_.find(k);
    if (it == memo_.end()) fail(at, "memo entry ", k, " was never stored");
    return it->second;
  }
  std::vector<ValuePtr> pop_mark(size_t at) {
    size_t k = stack_.size();
    while (k > 0 && stack_[k - 1]->kind != Kind::kMark) --k;
    if (k == 0) fail(at, "no MARK on the stack");
    std::vector<ValuePtr> out(stack_.begin() + long(k), stack_.end());
    stack_.resize(k - 1);
    return out;
  }
  Value* list(size_t at) {
    if (stack_.empty() || stack_.back()->kind != Kind::kList) fail(at, "APPEND(S) to something that is not a list");
    return stack_.back().get();
  }
  Value* dict(size_t at) {
    if (stack_.empty() || stack_.back()->kind != Kind::kDict) fail(at, "SETITEM(S) on something that is not a dict");
    return stack_.back().get();
  }
  void set_items(size_t at, Value& d, const std::vector<ValuePtr>& kv) {
    if (kv.size() % 2) fail(at, "a dict needs key/value pairs");
    for (size_t k = 0; k < kv.size(); k += 2) {
      if (kv[k]->kind != Kind::kStr) fail(at, "a dict key of type ", kind_name(kv[k]->kind), " (only str keys)");
      d.dict[kv[k]->s] = kv[k + 1];
    }
  }
  ValuePtr global(size_t at, const std::string& mod, const std::string& name) {
    const bool multiarray = mod == "numpy.core.multiarray" || mod == "numpy._core.multiarray";
    const bool latin1 = mod == "_codecs" && name == "encode";  // protocol 2's spelling of bytes
    const bool frombuffer = (mod == "numpy.core.numeric" || mod == "numpy._core.numeric") && name == "_frombuffer";
    if (frombuffer) {  // protocol 5's numeric arrays
      auto v = mk(Kind::kGlobal);
      v->s = "numpy.core.numeric._frombuffer";
      return v;
    }
    if (!latin1 && !((multiarray && (name == "_reconstruct" || name == "scalar")) ||
                     (mod == "numpy" && (name == "ndarray" || name == "dtype"))))
      fail(at, "global ", mod, ".", name, " is not allowed (only numpy's array reconstruction)");
    auto v = mk(Kind::kGlobal);
    v->s = (multiarray ? std::string("numpy.core.multiarray") : mod) + "." + name;
    return v;
  }
  void reduce(size_t at) {
    const ValuePtr args = pop(at), fn = pop(at);
    if (fn->kind != Kind::kGlobal || args->kind != Kind::kTuple) fail(at, "REDUCE of a non-global or without a tuple");
    const auto& a = args->items;
    if (fn->s == "numpy.core.multiarray._reconstruct") {
      if (a.size() != 3 || a[0]->kind != Kind::kGlobal || a[0]->s != "numpy.ndarray")
        fail(at, "_reconstruct must build a numpy.ndarray");
      auto v = mk(Kind::kArray);
      v->array = std::make_shared<Array>();
      push(v);
    } else if (fn->s == "numpy.dtype") {
      if (a.empty() || a[0]->kind != Kind::kStr) fail(at, "numpy.dtype needs a type string");
      auto v = mk(Kind::kDtype);
      v->s = a[0]->s == "O8" || a[0]->s == "O4" ? "O" : a[0]->s;
      push(v);
    } else if (fn->s == "numpy.core.numeric._frombuffer") {  // (buffer, dtype, shape, order)
      if (a.size() != 4 || a[0]->kind != Kind::kBytes || a[1]->kind != Kind::kDtype || a[2]->kind != Kind::kTuple ||
          a[3]->kind != Kind::kStr)
        fail(at, "_frombuffer(bytes, dtype, shape, order) expected");
      auto v = mk(Kind::kArray);
      v->array = std::make_shared<Array>();
      Array& arr = *v->array;
      for (const ValuePtr& d : a[2]->items)
        if (d->kind != Kind::kInt || !add_dim(arr, d->i))
          fail(at, "_frombuffer shape entries must be integers in [0, 2^40] (at most 2^40 elements)");
      arr.dtype = a[1]->s;
      const int64_t n = int_itemsize(arr.dtype);
      if (n == 0 || int64_t(a[0]->s.size()) != n * arr.numel())
        fail(at, "_frombuffer of ", a[0]->s.size(), " bytes as ", arr.numel(), " elements of ", arr.dtype);
      if (a[3]->s != "C" && arr.shape.size() > 1) fail(at, "Fortran-ordered arrays are not read");
      arr.data = a[0]->s;
      push(v);
    } else if (fn->s == "_codecs.encode") {  // _codecs.encode(str, "latin1"): code points < 256 as bytes
      if (a.size() != 2 || a[0]->kind != Kind::kStr || a[1]->kind != Kind::kStr ||
          (a[1]->s != "latin1" && a[1]->s != "latin-1"))
        fail(at, "_codecs.encode(str, 'latin1') expected");
      auto v = mk(Kind::kBytes);
      const std::string& u = a[0]->s;
      for (size_t k = 0; k < u.size();) {
        const uint8_t c = uint8_t(u[k]);
        if (c < 0x80) {
          v->s.push_back(char(c));
          ++k;
        } else if ((c & 0xE0) == 0xC0 && k + 1 < u.size() && c <= 0xC3) {
          v->s.push_back(char(((c & 0x1F) << 6) | (uint8_t(u[k + 1]) & 0x3F)));
          k += 2;
        } else {
          fail(at, "_codecs.encode: a character outside latin-1");
        }
      }
      push(v);
    } else if (fn->s == "numpy.core.multiarray.scalar") {  // a numpy integer or bool scalar
      if (a.size() != 2 || a[0]->kind != Kind::kDtype || a[1]->kind != Kind::kBytes)
        fail(at, "numpy scalar(dtype, bytes) expected");
      const int64_t n = int_itemsize(a[0]->s);
      if (n == 0 || int64_t(a[1]->s.size()) != n) fail(at, "numpy scalar of dtype ", a[0]->s, " (integers and bools only)");
      push(int_value(read_int_element(a[0]->s, a[1]->s.data())));
    } else {
      fail(at, "calling ", fn->s, " is not allowed");
    }
  }
  void build(size_t at) {
    const ValuePtr state = pop(at);
    if (stack_.empty()) fail(at, "BUILD on an empty stack");
    Value& obj = *stack_.back();
    if (state->kind != Kind::kTuple) fail(at, "BUILD state is not a tuple");
    const auto& s = state->items;
    if (obj.kind == Kind::kDtype) {
      if (s.size() < 2 || s[1]->kind != Kind::kStr) fail(at, "dtype state without a byte order");
      obj.i = s[1]->s.empty() ? '|' : s[1]->s[0];
      if (obj.i == '>') fail(at, "big-endian dtype ", obj.s);
      return;
    }
    if (obj.kind != Kind::kArray) fail(at, "BUILD on a ", kind_name(obj.kind));
    if (s.size() != 5 || s[1]->kind != Kind::kTuple || s[2]->kind != Kind::kDtype || s[3]->kind != Kind::kBool)
      fail(at, "ndarray state must be (version, shape, dtype, is_fortran, data)");
    Array& arr = *obj.array;
    for (const ValuePtr& d : s[1]->items)
      if (d->kind != Kind::kInt || !add_dim(arr, d->i))
        fail(at, "ndarray shape entries must be integers in [0, 2^40] (at most 2^40 elements)");
    arr.dtype = s[2]->s;
    if (s[3]->b && arr.shape.size() > 1) fail(at, "Fortran-ordered arrays are not read");
    if (arr.dtype == "O") {
      if (s[4]->kind != Kind::kList) fail(at, "an object array's data must be a list");
      arr.objects = s[4]->items;
      if (int64_t(arr.objects.size()) != arr.numel()) fail(at, "object array of ", arr.numel(), " elements holds ", arr.objects.size());
    } else {
      const int64_t n = int_itemsize(arr.dtype);
      if (n == 0) fail(at, "array dtype ", arr.dtype, " (integer and bool arrays only)");
      if (s[4]->kind != Kind::kBytes || int64_t(s[4]->s.size()) != n * arr.numel())
        fail(at, "array data of ", s[4]->s.size(), " bytes for ", arr.numel(), " elements of ", arr.dtype);
      arr.data = s[4]->s;
    }
  }

  ValuePtr mk(Kind k) {
    if (all_.size() > (size_t(1) << 26)) fail(pos_, "more than 2^26 values");
    all_.push_back(make(k));
    return all_.back();
  }
  // Marks what the result holds; a value inside itself (a cycle) or nesting deeper than 64 levels is not
  // a NumPy record layout. Shared values (memo reuse) are fine.
  void keep(size_t at, const Value* v, int depth) {
    if (depth > 64) fail(at, "values nested deeper than 64 levels");
    if (!path_.insert(v).second) fail(at, "a value that contains itself");
    if (kept_.insert(v).second) {
      for (const ValuePtr& x : v->items) keep(at, x.get(), depth + 1);
      for (const auto& [k, x] : v->dict) keep(at, x.get(), depth + 1);
      if (v->array)
        for (const ValuePtr& x : v->array->objects) keep(at, x.get(), depth + 1);
    }
    path_.erase(v);
  }

  const std::string& file_;
  const std::string& d_;
  size_t pos_;
  std::vector<ValuePtr> all_;
  std::set<const Value*> kept_, path_;
  bool ok_ = false;  // the result was returned: keep what it holds
  std::vector<ValuePtr> stack_;
  std::unordered_map<uint32_t, ValuePtr> memo_;
};

// The value of 'key': ... in numpy's header dict literal (a quoted string, True/False or a tuple).
std::string header_field(const std::string& file, const std::string& h, const std::string& key) {
  const size_t k = h.find("'" + key + "'");
  if (k == std::string::npos) user_error(file, ": .npy header has no '", key, "': ", h);
  size_t p = h.find(':', k);
  if (p == std::string::npos) user_error(file, ": malformed .npy header: ", h);
  ++p;
  while (p < h.size() && h[p] == ' ') ++p;
  size_t e = p;
  if (h[p] == '\'') {
    e = h.find('\'', p + 1);
    return e == std::string::npos ? "" : h.substr(p + 1, e - p - 1);
  }
  if (h[p] == '(') {
    e = h.find(')', p);
    return e == std::string::npos ? "" : h.substr(p + 1, e - p - 1);
  }
  while (e < h.size() && h[e] != ',' && h[e] != '}') ++e;
  return h.substr(p, e - p);
}

}  // namespace

Array load_npy(const std::string& path) {
  const std::string d = read_file(path, "--train-data-path/--valid-data-path .npy");
  if (d.size() < 10 || d.compare(0, 6, "\x93NUMPY") != 0) user_error(path, ": not a .npy file (no \\x93NUMPY magic)");
  const int major = uint8_t(d[6]);
  size_t hlen = 0, off = 0;
  if (major == 1) {
    hlen = uint8_t(d[8]) | size_t(uint8_t(d[9])) << 8;
    off = 10;
  } else if (major == 2 || major == 3) {
    if (d.size() < 12) user_error(path, ": truncated .npy header");
    uint32_t v;
    std::memcpy(&v, d.data() + 8, 4);
    hlen = v;
    off = 12;
  } else {
    user_error(path, ": .npy format version ", major, " (1, 2 and 3 are read)");
  }
  if (off + hlen > d.size()) user_error(path, ": truncated .npy header");
  const std::string h = d.substr(off, hlen);
  const std::string descr = header_field(path, h, "descr");
  if (header_field(path, h, "fortran_order").find("False") == std::string::npos)
    user_error(path, ": Fortran-ordered .npy arrays are not read");
  Array arr;
  const std::string shape = header_field(path, h, "shape") + ",";
  for (size_t p = 0; p < shape.size();) {
    const size_t c = shape.find(',', p);
    std::string tok = shape.substr(p, c - p);
    tok.erase(0, tok.find_first_not_of(' '));
    tok.erase(tok.find_last_not_of(' ') + 1);
    if (!tok.empty()) {
      int64_t dim = -1;
      const auto r = std::from_chars(tok.data(), tok.data() + tok.size(), dim);
      if (r.ec != std::errc() || r.ptr != tok.data() + tok.size() || !add_dim(arr, dim))
        user_error(path, ": .npy header shape '", shape.substr(0, shape.size() - 1), "' (integers, at most 2^40 elements)");
    }
    p = c + 1;
  }
  const size_t data = off + hlen;
  if (descr == "|O") {
    const ValuePtr v = Unpickler(path, d, data).run();
    if (v->kind != Value::Kind::kArray || v->array->dtype != "O")
      user_error(path, ": the pickle holds a ", kind_name(v->kind), ", expected a NumPy object array");
    if (v->array->shape != arr.shape) user_error(path, ": the pickled array's shape differs from the .npy header's");
    return std::move(*v->array);
  }
  if (descr.size() < 3 || (descr[0] != '<' && descr[0] != '|')) user_error(path, ": .npy dtype '", descr, "' is not read");
  arr.dtype = descr.substr(1);
  const int64_t n = int_itemsize(arr.dtype);
  if (n == 0) user_error(path, ": .npy dtype '", descr, "' (integer and bool arrays only)");
  if (int64_t(d.size() - data) != n * arr.numel())
    user_error(path, ": .npy data holds ", d.size() - data, " bytes, the header says ", n * arr.numel());
  arr.data = d.substr(data);
  return arr;
}

std::vector<int64_t> int_list(const Value& v, const std::string& what) {
  std::vector<int64_t> out;
  if (v.kind == Kind::kList || v.kind == Kind::kTuple) {
    for (const ValuePtr& x : v.items) {
      if (x->kind == Kind::kInt) out.push_back(x->i);
      else if (x->kind == Kind::kBool) out.push_back(x->b ? 1 : 0);
      else user_error(what, ": a list element of type ", kind_name(x->kind), " (integers expected)");
    }
    return out;
  }
  if (v.kind == Kind::kArray && v.array->dtype != "O" && v.array->shape.size() == 1) {
    const int64_t n = int_itemsize(v.array->dtype);
    for (int64_t k = 0; k < v.array->numel(); ++k) out.push_back(read_int_element(v.array->dtype, v.array->data.data() + k * n));
    return out;
  }
  user_error(what, ": a ", kind_name(v.kind), " (a list of integers or a 1-D integer array expected)");
}

}  // namespace loom::npy
