// A static HTML report: a title, an introduction, then sections of paragraphs, figures (SVG files
// referenced by <img>), tables and preformatted program output. Everything given as text is
// escaped; the only markup in paragraphs is `code`, which becomes <code>code</code>.
#pragma once

#include <string>
#include <variant>
#include <vector>

namespace attn::viz {

struct Table {
  std::vector<std::string> header;
  std::vector<std::vector<std::string>> rows;  // each as long as the header
  std::string caption;
};

class Section {
 public:
  Section(std::string id, std::string title);

  Section& paragraph(std::string text);
  // `src` is a path relative to the report (the figure file sits beside index.html).
  Section& figure(std::string src, std::string caption, std::string alt = {});
  Section& table(Table table);
  Section& preformatted(std::string text);

  const std::string& id() const { return id_; }
  const std::string& title() const { return title_; }
  // The figure files the section references, in order.
  std::vector<std::string> figure_sources() const;
  std::string html() const;

 private:
  struct Paragraph {
    std::string text;
  };
  struct Figure {
    std::string src, caption, alt;
  };
  struct Preformatted {
    std::string text;
  };
  std::string id_, title_;
  std::vector<std::variant<Paragraph, Figure, Table, Preformatted>> blocks_;
};

class Report {
 public:
  explicit Report(std::string title);
  Report& intro(std::string text);  // a paragraph before the table of contents
  // Appends a section and returns it for filling; ids must be unique ([a-z0-9-]).
  Section& section(std::string id, std::string title);

  const std::vector<Section>& sections() const { return sections_; }
  std::string html() const;
  // html(), written atomically.
  void write(const std::string& path) const;

 private:
  std::string title_;
  std::vector<std::string> intro_;
  std::vector<Section> sections_;
};

// Escaped text with `code` spans turned into <code> elements (an unmatched backtick stays).
std::string inline_markup(const std::string& text);

}  // namespace attn::viz
